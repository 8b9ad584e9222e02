"""Prefill: writing the KV of given tokens (prompts, appends, chat messages) in chunked forwards, and scoring
them (each token's log-probability given what precedes it) when asked.

All or nothing through the call's journal: a failure or Ctrl-C between chunks undoes the chunks done.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..forward import ForwardRunner
from ..kv import AppendRecord, BranchTree
from ..model.transformer import CausalLM
from ..sampling import token_logprobs
from .branch_state import Branch
from .inputs import Inputs
from .preemption import Preemption

SCORE_ROWS = 128  # hidden states per LM-head call when appended tokens are scored

Chunk = list[tuple[AppendRecord, list[int]]]   # (what one append did, the tokens it appended) per run


def run_chunk(tree: BranchTree, runner: ForwardRunner, chunk: Chunk) -> None:
    """One forward over runs of tokens just appended to the tree: plan it, then run it on their ids."""
    planned = runner.plan(tree, [record for record, _ in chunk], [len(t) for _, t in chunk])
    runner.run(planned, [t for _, tokens in chunk for t in tokens])


class Prefill:
    def __init__(self, tree: BranchTree, runner: ForwardRunner, model: CausalLM, inputs: Inputs,
                 preemption: Preemption, check_interrupt: Callable[[], None], chunk_tokens: int):
        self.tree, self.runner, self.model, self.inputs = tree, runner, model, inputs
        self.preemption, self.check_interrupt = preemption, check_interrupt
        self.chunk_tokens = chunk_tokens   # tokens per forward (Engine.prefill_chunk_tokens)

    def __call__(self, pairs: list[tuple[Branch, list[int]]], logprobs: bool = False) -> None:
        """Write every token's KV, at most chunk_tokens per forward (but every branch's next token fits one
        forward, so a decode step is always one forward). With logprobs, each token keeps its log-probability
        given what precedes it."""
        if not pairs:
            return
        total = sum(len(t) for _, t in pairs)
        where = f"branch {pairs[0][0].name!r}" if len(pairs) == 1 else f"{len(pairs)} branches"
        self.inputs.check_blocks([(b, len(t)) for b, t in pairs], f"appending {total:,} tokens to {where}")
        self.preemption.resume_all([branch for branch, _ in pairs])
        budget_per_forward = max(self.chunk_tokens, len(pairs))
        done = [0] * len(pairs)
        while any(d < len(t) for d, (_, t) in zip(done, pairs)):
            if any(done):
                self.check_interrupt()   # between chunks: the call's rollback undoes the chunks done
            budget, chunk = budget_per_forward, []
            for i, (branch, tokens) in enumerate(pairs):
                take = min(len(tokens) - done[i], budget)
                if take <= 0:
                    continue
                piece = tokens[done[i]: done[i] + take]
                chunk.append((self.tree.append(branch, piece), piece))
                done[i] += take
                budget -= take
            # What predicts each run's first token: the hidden state its branch ended on before it.
            before = [record.old_last_hidden if not record.created else record.from_node.last_hidden
                      for record, _ in chunk] if logprobs else None
            self.runner.keep_all_hidden = logprobs
            try:
                run_chunk(self.tree, self.runner, chunk)
            finally:
                self.runner.keep_all_hidden = False
            if logprobs:
                self._keep_logprobs(chunk, before, self.runner.all_hidden)

    def _keep_logprobs(self, chunk: Chunk, before: list[Any], hidden: torch.Tensor) -> None:
        """Score one prefill forward's tokens: token j of a run is predicted by the hidden state of token j - 1
        (hidden [T, hidden], the runs one after another), its first token by `before` (None: unscored)."""
        predictors, targets, places, offset = [], [], [], 0
        for (record, piece), first in zip(chunk, before):
            start = 0 if record.created else record.old_num_tokens  # the run's first index in its node's tokens
            rows = hidden[offset: offset + len(piece) - 1]
            if first is not None:
                rows = torch.cat([first.unsqueeze(0), rows])
            scored = range(len(piece)) if first is not None else range(1, len(piece))
            predictors.append(rows)
            targets += [piece[j] for j in scored]
            places += [(record.node, start + j) for j in scored]
            offset += len(piece)
        rows = torch.cat(predictors)
        target_ids = torch.tensor(targets, device=rows.device)
        kept: list[float] = []
        for at in range(0, len(rows), SCORE_ROWS):  # the logits of 128 rows of a 152k vocabulary: 78 MB
            logits = self.model.logits(rows[at: at + SCORE_ROWS]).float()
            kept += token_logprobs(logits, target_ids[at: at + SCORE_ROWS]).tolist()
        for (node, index), logprob in zip(places, kept):
            node.keep_logprob(index, logprob)
