"""The decode step, named: DecodeLoop.step() is schedule -> plan -> sample -> launch -> postprocess.

One generate() call is one DecodeLoop. Each step decodes one token for each of its rows (the branches scheduled
for it) in one batched forward:

- schedule: the rows were chosen (priority, then tree order) and given room in the pool at the last step
  boundary; their LM head launches now, and their grammar masks start to fill on a worker.
- plan: the token-free half of the forward (each row grows by one pending position, blocks, attention plan),
  built on the host while the GPU still computes the logits.
- sample: on the device, under the masks; no host sync.
- launch: the forward starts on the sampled tokens as they lie on the device; the host reads them back meanwhile.
- postprocess: the tokens replace the pending ones, grammars move on, outputs grow, stops are found, and the step
  is committed (kv/journal.py): whatever happens later, it stays.

Between steps, generate() hands listeners a DecodeStep event, then reschedule() picks the next rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..config import is_count
from ..events import DecodeStep
from ..forward import ForwardRunner, PlannedForward
from ..kv import BranchTree
from ..kv.journal import Journal
from ..model.transformer import CausalLM
from ..sampling import SamplingParams, sample, token_logprobs
from .branch_state import Branch
from .grammars import Grammars, Masks
from .inputs import Inputs
from .preemption import Preemption

# A decode step appends a placeholder for each branch's next token before that token is sampled (so the
# step is planned while the GPU is still busy), and puts the sampled token in its place before the forward.
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """What one generate() call asks for, checked (Engine.generate)."""

    branches: list[Branch]     # in the call's order: outputs follow it
    max_new_tokens: int
    sampling: SamplingParams
    max_batch: int             # rows per step at most (all the branches when the call set none)
    logprobs: bool             # keep each sampled token's log-probability

    @classmethod
    def checked(cls, branches: list[Branch], max_new_tokens: Any, sampling: SamplingParams, max_batch: Any,
                logprobs: Any) -> GenerateCall:
        """The call, from branches and a budget Engine.check_generate has checked, and the other arguments."""
        if max_batch is not None and not is_count(max_batch):
            raise ValueError(f"max_batch must be a positive int (branches per step), got {max_batch!r}.")
        if not isinstance(logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {logprobs!r}.")
        limit = len(branches) if max_batch is None else int(max_batch)
        # numpy's ints too: events and errors carry max_new_tokens as an int
        return cls(branches, int(max_new_tokens), sampling, limit, logprobs)


@dataclass(frozen=True, slots=True)
class StepDone:
    """What one step did (DecodeStep carries it to listeners)."""

    index: int                 # 0 for the call's first step
    rows: list[int]            # the call's branches this step decoded, by index in GenerateCall.branches
    tokens: list[int]          # the token each row drew
    logprobs: tuple[float, ...] | None  # their log-probabilities, when the call keeps them
    finished: list[int]        # rows stopped by EOS, a stop string or a complete grammar
    seconds: float             # wall time of the step, host side


@dataclass(frozen=True, slots=True)
class DecodeParts:
    """What a decode step works with; the engine owns them all."""

    tree: BranchTree
    runner: ForwardRunner
    model: CausalLM
    inputs: Inputs
    preemption: Preemption
    grammars: Grammars
    journal: Journal
    device: torch.device


class DecodeLoop:
    """The steps of one generate() call. begin() first, then step() until `pending` is empty, with reschedule()
    between steps; abort() on any failure."""

    def __init__(self, parts: DecodeParts, call: GenerateCall):
        self.parts, self.call = parts, call
        resolved = call.branches
        self.outputs: list[list[int]] = [[] for _ in resolved]
        self.steps_done = 0
        self.pending = list(range(len(resolved)))   # rows still to decode, in the call's order
        # Only a limited batch picks: each branch's rank in a depth-first walk keeps siblings together.
        self._tree_rank = self._tree_order() if call.max_batch < len(resolved) else None
        self.max_steps = call.max_new_tokens * -(-len(resolved) // call.max_batch)  # exact unless re-ranked
        self._stop_window = max((len(s.encode()) for s in call.sampling.stop), default=0)
        self._generators: list[torch.Generator | None] = []
        self._masks: Masks | None = None
        # First, while nothing awaits undo: making room preempts other branches and commits (Preemption.make_room).
        self.rows = parts.preemption.fit(resolved, self._choose())

    def begin(self, constraint: Any = None) -> None:
        """Put the call's branches under `constraint` (if given) and make the generators sampling needs."""
        parts, call = self.parts, self.call
        if constraint is not None:
            parts.grammars.attach(call.branches, constraint)
        # Greedy steps draw no noise, so an unseeded greedy call leaves each branch's generator unmade until a
        # sampled call needs it (made then from the same seed, in the same state). Making 1,000 took 7 ms.
        draws = not call.sampling.greedy or call.sampling.seed is not None
        self._generators = ([b.sampler(parts.journal, call.sampling.seed, parts.device) for b in call.branches]
                            if draws else [None] * len(call.branches))

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> StepDone:
        """Decode one token for each scheduled row: schedule -> plan -> sample -> launch -> postprocess."""
        started = time.perf_counter()
        rows = self.rows
        branches = [self.call.branches[i] for i in rows]
        logits = self._schedule(branches)
        histories = ([self.parts.tree.path_tokens(b.node) for b in branches]
                     if self.call.sampling.repetition_penalty != 1.0 else None)
        planned = self._plan(branches)   # while the GPU still computes these logits (and the forward before them)
        sampled, picked = self._sample(rows, logits, histories)
        drawn, drawn_logprobs = self._launch(planned, sampled, picked)
        finished = self._postprocess(rows, branches, drawn)
        self.steps_done += 1
        return StepDone(self.steps_done - 1, rows, drawn, drawn_logprobs, finished, time.perf_counter() - started)

    def _schedule(self, branches: list[Branch]) -> torch.Tensor:
        """Start the masks filling (constrained rows) and launch the LM head: [rows, vocab] logits."""
        self._masks = self.parts.grammars.start_masks(branches)
        return self.parts.model.logits(self.parts.runner.hidden_of([b.node for b in branches]))

    def _plan(self, branches: list[Branch]) -> PlannedForward:
        """The token-free half of the step: each row grows by one position (blocks allocated, the forward
        planned and staged), holding PENDING_TOKEN until _launch. Raises before changing anything when the pool
        cannot hold the step (reschedule has made room; the count per row runs only near a full pool)."""
        parts = self.parts
        if not parts.preemption.fits(branches, range(len(branches))):
            parts.inputs.check_blocks([(b, 1) for b in branches], f"a decode step of {len(branches)} branch(es)")
        parts.preemption.resume_all(branches)
        records = parts.tree.append_one_each(branches, PENDING_TOKEN)  # undone by the call's rollback on failure
        return parts.runner.plan(parts.tree, records, [1] * len(records))

    def _sample(self, rows: list[int], logits: torch.Tensor,
                histories: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' next tokens [rows] on the device, and their log-probabilities when the call keeps them."""
        call = self.call
        # Before the mask, which writes -inf in place; the sampled token's own logit it leaves.
        normaliser = torch.logsumexp(logits, dim=-1) if call.logprobs else None
        if self._masks is not None:
            self.parts.grammars.apply(logits, self._masks)
        sampled = sample(logits, call.sampling, [self._generators[i] for i in rows], histories)
        return sampled, token_logprobs(logits, sampled, normaliser) if call.logprobs else None

    def _launch(self, planned: PlannedForward, tokens: torch.Tensor,
                logprobs: torch.Tensor | None) -> tuple[list[int], tuple[float, ...] | None]:
        """Run the step's forward on the sampled tokens as they lie on the device, read them back (a wait for the
        sampler only: the forward keeps running) and put them in place of the pending ones, with their
        log-probabilities when given."""
        runner = self.parts.runner
        read = runner.read_back(tokens) if logprobs is None else runner.read_back(tokens, logprobs)
        runner.run(planned, tokens)
        drawn, *kept = read()
        for record, token in zip(planned.records, drawn):
            record.node.tokens[-1] = token
        if kept:
            for record, logprob in zip(planned.records, kept[0]):
                record.node.keep_logprob(len(record.node.tokens) - 1, logprob)
        return drawn, tuple(kept[0]) if kept else None

    def _postprocess(self, rows: list[int], branches: list[Branch], drawn: list[int]) -> list[int]:
        """Grammars move past the tokens (so the next masks fill during the next forward), outputs grow, the
        step is committed, and rows that are done leave `pending`. Returns the rows that finished by a stop."""
        if any(b.matcher is not None for b in branches):
            self.parts.grammars.advance(branches, drawn)
        self.parts.journal.commit()   # the step is done: it stays, whatever happens next
        finished, done = [], set()
        for i, branch, token in zip(rows, branches, drawn):
            output = self.outputs[i]
            output.append(token)
            if self._stopped(output) or (branch.matcher is not None and branch.matcher.is_stopped()):
                finished.append(i)
                done.add(i)
            elif len(output) == self.call.max_new_tokens:
                done.add(i)
        self.pending = [i for i in self.pending if i not in done]
        return finished

    def _stopped(self, generated: list[int]) -> bool:
        """Whether a branch's output just reached EOS or completed a stop string."""
        sampling = self.call.sampling
        if generated[-1] in self.parts.inputs.eos_token_ids and not sampling.ignore_eos:
            return True
        if self._stop_window:  # each token is at least one byte, so this window holds any stop string just completed
            tail = self.parts.inputs.detokenize(generated[-self._stop_window:])
            return any(stop in tail for stop in sampling.stop)
        return False

    # ---- between steps --------------------------------------------------------------------------------
    def event(self, done: StepDone) -> DecodeStep:
        names = [b.name for b in self.call.branches]
        return DecodeStep(done.index, self.max_steps, tuple(names[i] for i in done.rows), tuple(done.tokens),
                          tuple(names[i] for i in done.finished), done.seconds, done.logprobs)

    def drop_pruned(self) -> None:
        """A listener pruned some of the call's branches: they leave the call (the others go on)."""
        live = self.parts.tree.branches
        self.pending = [i for i in self.pending if live.get(self.call.branches[i].name) is self.call.branches[i]]

    def reschedule(self) -> None:
        """Choose the next step's rows and make room for them (at a step boundary: see Preemption.make_room)."""
        self.rows = self.parts.preemption.fit(self.call.branches, self._choose())

    def _choose(self) -> list[int]:
        """The rows of the next step: all pending ones, or the max_batch of highest priority (re-read every step,
        so a listener can re-rank), ties by tree place so siblings share a batch."""
        pending, limit, resolved = self.pending, self.call.max_batch, self.call.branches
        if len(pending) <= limit:
            return list(pending)
        rank = self._tree_rank
        chosen = sorted(pending, key=lambda i: (-resolved[i].priority, rank[i], i))[:limit]
        return sorted(chosen, key=lambda i: rank[i])

    def _tree_order(self) -> list[int]:
        """Each branch's rank in a depth-first walk of the tree: siblings and cousins rank next to each other."""
        rank = {id(node): r for r, node in enumerate(self.parts.tree.nodes())}
        return [rank[id(branch.node)] for branch in self.call.branches]

    # ---- the end ----------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for a mask fill still running (a listener may have dropped the rows it was for)."""
        masks, self._masks = self._masks, None
        if masks is not None:
            masks[1].result()

    def abort(self) -> None:
        """After a failure: let a running mask fill end (it must not overlap the grammars' undo), then undo the
        unfinished step; the steps before it were committed."""
        masks, self._masks = self._masks, None
        if masks is not None:
            try:
                masks[1].result()
            except Exception:   # the fill's own error is not the one to report
                pass
        self.parts.journal.rollback()

