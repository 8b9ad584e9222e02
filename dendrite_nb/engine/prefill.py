"""Prefill: writing the KV of given tokens (prompts, appends, chat messages) in chunked forwards, and scoring
them (each token's log-probability given what precedes it) when asked.

Tokens the tree holds already below a branch's node are not prefilled again: the branch moves down over them
first (prefix reuse, kv/prefix.py), unless the call scores its tokens, which needs every token's forward. What
each call reused and prefilled is its PrefillReport.

All or nothing through the call's journal: a failure or Ctrl-C between chunks undoes the chunks done.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch

from ..forward import ForwardRunner
from ..kv import AppendRecord, BranchTree
from ..kv.journal import restore_attrs
from ..kv.prefix import reuse
from ..model.transformer import CausalLM
from ..sampling import token_logprobs
from .branch_state import Branch
from .inputs import Inputs
from .preemption import Preemption

SCORE_ROWS = 128  # hidden states per LM-head call when appended tokens are scored

Chunk = list[tuple[AppendRecord, list[int]]]   # (what one append did, the tokens it appended) per run
Method = TypeVar("Method", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """The tokens an engine call added to branches, by how their KV came to be."""

    reused_tokens: int = 0      # held by the tree already (prefix reuse): no forward ran over them
    prefilled_tokens: int = 0   # written by prefill forwards

    def __add__(self, other: PrefillReport) -> PrefillReport:
        return PrefillReport(self.reused_tokens + other.reused_tokens, self.prefilled_tokens + other.prefilled_tokens)


def reports_prefill(method: Method) -> Method:
    """An Engine call whose prefills make up one PrefillReport (Prefill.reporting), under engine_call."""
    @functools.wraps(method)
    def call(engine: Any, *args: Any, **kwargs: Any) -> Any:
        with engine._prefill.reporting():
            return method(engine, *args, **kwargs)
    return call  # type: ignore[return-value]


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
        self.reuse_prefixes = True   # Engine.prefix_reuse
        # The last reporting call's counts, and the sum of every call's since the engine was made.
        self.report, self.totals = PrefillReport(), PrefillReport()
        self._reporting = 0   # depth of nested reporting calls (write -> append -> ...)

    @contextmanager
    def reporting(self) -> Iterator[None]:
        """The prefills within make up one call's report; a call nested in another adds to the outer one's."""
        if not self._reporting:
            self._count(PrefillReport(), fresh=True)
        self._reporting += 1
        try:
            yield
        finally:
            self._reporting -= 1

    def _count(self, counts: PrefillReport, fresh: bool = False) -> None:
        """Add to the current call's report and the totals (logged: a call that fails leaves both as they were)."""
        self.tree.journal.log(restore_attrs, self, {"report": self.report, "totals": self.totals})
        self.report = counts if fresh else self.report + counts
        self.totals += counts

    def __call__(self, pairs: list[tuple[Branch, list[int]]], logprobs: bool = False) -> None:
        """Write every token's KV, at most chunk_tokens per forward (but every branch's next token fits one
        forward, so a decode step is always one forward); tokens the tree holds already below a branch are
        reused instead (not when scoring). With logprobs, each token keeps its log-probability given what
        precedes it."""
        reused = 0
        if self.reuse_prefixes and not logprobs:
            pairs, reused = self._skip_known(pairs)
        total = sum(len(t) for _, t in pairs)
        self._count(PrefillReport(reused, total))
        if not pairs:
            return
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

    def _skip_known(self, pairs: list[tuple[Branch, list[int]]]) -> tuple[list[tuple[Branch, list[int]]], int]:
        """Each branch moved over the run of its tokens the tree holds (kv/prefix.py), and the tokens left to
        prefill (branches left with none dropped); and how many tokens were reused."""
        tree, left, reused = self.tree, [], 0
        for branch, tokens in pairs:
            node = branch.node
            if tokens and node.children and not node.swapped_blocks:   # else there is nothing below it to reuse
                count, copy = reuse(tree, branch, tokens)
                if copy is not None:
                    self.runner.pool.copy_block(*copy)
                tokens, reused = tokens[count:], reused + count
            if tokens:
                left.append((branch, tokens))
        return left, reused

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
