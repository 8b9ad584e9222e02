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

Between steps, generate() hands listeners a DecodeStep event, then reschedule() picks the next rows. Rows may also
join between steps (join(): continuous batching, as dendrite_nb/serve/ runs it), each with its own settings: sampling,
token budget, log-probabilities. Each row that ends says why (FINISH_REASONS), and so does its branch.
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
from ..sampling import SamplingParams, sample, sample_rows, token_logprobs
from .branch_state import Branch
from .grammars import Grammars, Masks
from .inputs import Inputs
from .preemption import Preemption

# A decode step appends a placeholder for each branch's next token before that token is sampled (so the
# step is planned while the GPU is still busy), and puts the sampled token in its place before the forward.
PENDING_TOKEN = -1

# Why a row stopped: its end-of-sequence token, a stop string, its grammar complete, or its token budget spent.
FINISH_REASONS = ("eos", "stop_string", "grammar_complete", "max_tokens")
# Alternatives per sampled token a row may ask for (as OpenAI's top_logprobs allows).
MAX_TOP_LOGPROBS = 20


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
class RowSettings:
    """How one row decodes: generate() gives all its rows one; rows that join a running loop bring their own."""

    sampling: SamplingParams
    max_new_tokens: int
    logprobs: bool             # keep each sampled token's log-probability
    top_logprobs: int = 0      # report this many most likely tokens (and their log-probabilities) per step

    @property
    def stop_window(self) -> int:
        """Tokens whose text can hold a stop string just completed (each token is at least one byte)."""
        return max((len(s.encode()) for s in self.sampling.stop), default=0)


@dataclass(frozen=True, slots=True)
class StepDone:
    """What one step did (DecodeStep carries it to listeners)."""

    index: int                 # 0 for the call's first step
    rows: list[int]            # the call's branches this step decoded, by index in GenerateCall.branches
    tokens: list[int]          # the token each row drew
    logprobs: tuple[float, ...] | None  # their log-probabilities, when the call keeps them
    finished: list[int]        # rows stopped by EOS, a stop string or a complete grammar
    seconds: float             # wall time of the step, host side
    ended: dict[int, str]      # every row that ended this step (those in `finished` and those out of budget): why
    # Per row, the most likely tokens and their log-probabilities, best first, for rows that ask (else None).
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


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
    """The steps of one generate() call, or of a batch that rows join and leave (dendrite_nb/serve/). begin()
    first, then step() until `pending` is empty, with reschedule() between steps; abort() on any failure.
    join() adds rows between steps."""

    def __init__(self, parts: DecodeParts, call: GenerateCall):
        self.parts, self.call = parts, call
        resolved = call.branches
        self.branches: list[Branch | None] = list(resolved)   # by row; None once a finished row is forgotten
        settings = RowSettings(call.sampling, call.max_new_tokens, call.logprobs)
        self.settings: list[RowSettings] = [settings] * len(resolved)
        self._uniform: RowSettings | None = settings   # every row's settings, while they are all the same
        self.outputs: list[list[int]] = [[] for _ in resolved]
        self.finish_reasons: list[str | None] = [None] * len(resolved)
        self.steps_done = 0
        self.pending = list(range(len(resolved)))   # rows still to decode, in the call's order
        # Only a limited batch picks: each branch's rank in a depth-first walk keeps siblings together.
        self._tree_rank = self._tree_order() if call.max_batch < len(resolved) else None
        self.max_steps = call.max_new_tokens * -(-len(resolved) // call.max_batch)  # exact unless re-ranked
        self._generators: list[torch.Generator | None] = []
        self._masks: Masks | None = None
        # First, while nothing awaits undo: making room preempts other branches and commits (Preemption.make_room).
        self.rows = parts.preemption.fit(resolved, self._choose()) if resolved else []

    def begin(self, constraint: Any = None) -> None:
        """Put the call's branches under `constraint` (if given) and make the generators sampling needs."""
        self._generators = self._start(self.call.branches, self.settings[0] if self.settings else None, constraint)

    def _start(self, branches: list[Branch], settings: RowSettings | None, constraint: Any) -> list:
        parts = self.parts
        if constraint is not None:
            parts.grammars.attach(branches, constraint)
        if settings is None:
            return []
        # Greedy steps draw no noise, so an unseeded greedy call leaves each branch's generator unmade until a
        # sampled call needs it (made then from the same seed, in the same state). Making 1,000 took 7 ms.
        sampling = settings.sampling
        draws = not sampling.greedy or sampling.seed is not None
        return ([b.sampler(parts.journal, sampling.seed, parts.device) for b in branches] if draws
                else [None] * len(branches))

    def join(self, branches: list[Branch], settings: RowSettings, constraint: Any = None) -> list[int]:
        """Add rows between steps (the caller checked them as generate checks its branches, and that none is in
        the loop already); they decode from the next step on. Returns their row numbers."""
        rows = list(range(len(self.branches), len(self.branches) + len(branches)))
        generators = self._start(branches, settings, constraint)
        self.branches.extend(branches)
        self.settings.extend([settings] * len(branches))
        self._generators.extend(generators)
        self.outputs.extend([] for _ in branches)
        self.finish_reasons.extend([None] * len(branches))
        self.pending.extend(rows)
        if self._uniform is not settings:
            self._uniform = None
        self.max_steps = max(self.max_steps, self.steps_done + settings.max_new_tokens)
        return rows

    def forget(self, rows: list[int]) -> None:
        """Let go of ended rows' outputs and branches (a long-running batch would otherwise keep them all)."""
        for row in rows:
            if row not in self.pending:
                self.branches[row] = self._generators[row] = None
                self.outputs[row] = []

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> StepDone:
        """Decode one token for each scheduled row: schedule -> plan -> sample -> launch -> postprocess."""
        started = time.perf_counter()
        rows = self.rows
        branches = [self.branches[i] for i in rows]
        logits = self._schedule(branches)
        penalised = [i for i in rows if self.settings[i].sampling.repetition_penalty != 1.0]
        histories = [self.parts.tree.path_tokens(b.node) for b in branches] if penalised else None
        planned = self._plan(branches)   # while the GPU still computes these logits (and the forward before them)
        sampled, picked, top = self._sample(rows, logits, histories)
        drawn, drawn_logprobs, alternatives = self._launch(rows, planned, sampled, picked, top)
        ended = self._postprocess(rows, branches, drawn)
        finished = [i for i in rows if ended.get(i, "max_tokens") != "max_tokens"]
        self.steps_done += 1
        return StepDone(self.steps_done - 1, rows, drawn, drawn_logprobs, finished, time.perf_counter() - started,
                        ended, alternatives)

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

    def _sample(self, rows: list[int], logits: torch.Tensor, histories: list[list[int]] | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The rows' next tokens [rows] on the device; their log-probabilities when a row keeps them; and the
        top alternatives ([rows, k] log-probabilities and ids) when a row asks for them."""
        uniform = self._uniform
        settings = [uniform] * len(rows) if uniform is not None else [self.settings[i] for i in rows]
        keep = uniform.logprobs if uniform is not None else any(s.logprobs for s in settings)
        top_k = uniform.top_logprobs if uniform is not None else max(s.top_logprobs for s in settings)
        # Before the mask, which writes -inf in place; the sampled token's own logit it leaves.
        normaliser = torch.logsumexp(logits, dim=-1) if keep or top_k else None
        top = None
        if top_k:
            values, ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
            top = (values.float() - normaliser.float().unsqueeze(1), ids)
        if self._masks is not None:
            self.parts.grammars.apply(logits, self._masks)
        generators = [self._generators[i] for i in rows]
        if uniform is not None:
            sampled = sample(logits, uniform.sampling, generators, histories)
        else:  # rows that joined with their own settings: one launch on a GPU
            sampled = sample_rows(logits, [s.sampling for s in settings], generators, histories)
        return sampled, token_logprobs(logits, sampled, normaliser) if keep else None, top

    def _launch(self, rows: list[int], planned: PlannedForward, tokens: torch.Tensor, logprobs: torch.Tensor | None,
                top: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[list[int], tuple[float, ...] | None, list[list[tuple[int, float]] | None] | None]:
        """Run the step's forward on the sampled tokens as they lie on the device, read them back (a wait for the
        sampler only: the forward keeps running) and put them in place of the pending ones, with their
        log-probabilities when kept, and the top alternatives of rows that ask for them."""
        runner = self.parts.runner
        extra = ([logprobs] if logprobs is not None else []) + ([top[0].flatten(), top[1].flatten()] if top else [])
        read = runner.read_back(tokens, *extra)
        runner.run(planned, tokens)
        drawn, *kept = read()
        for record, token in zip(planned.records, drawn):
            record.node.tokens[-1] = token
        drawn_logprobs = None
        if logprobs is not None:
            drawn_logprobs = tuple(kept.pop(0))
            uniform = self._uniform is not None
            for row, record, logprob in zip(rows, planned.records, drawn_logprobs):
                if uniform or self.settings[row].logprobs:
                    record.node.keep_logprob(len(record.node.tokens) - 1, logprob)
        alternatives = None
        if top is not None:
            width = top[0].shape[1]
            values, ids = kept
            alternatives = []
            for n, row in enumerate(rows):
                wanted = self.settings[row].top_logprobs
                pairs = list(zip(ids[n * width:n * width + wanted], values[n * width:n * width + wanted]))
                alternatives.append(pairs if wanted else None)
        return drawn, drawn_logprobs, alternatives

    def _postprocess(self, rows: list[int], branches: list[Branch], drawn: list[int]) -> dict[int, str]:
        """Grammars move past the tokens (so the next masks fill during the next forward), outputs grow, the
        step is committed, and rows that are done leave `pending`. Returns the rows that ended, with why."""
        if any(b.matcher is not None for b in branches):
            self.parts.grammars.advance(branches, drawn)
        self.parts.journal.commit()   # the step is done: it stays, whatever happens next
        ended: dict[int, str] = {}
        uniform = self._uniform
        for i, branch, token in zip(rows, branches, drawn):
            output = self.outputs[i]
            output.append(token)
            settings = uniform if uniform is not None else self.settings[i]
            reason = self._stopped(output, settings)
            if reason is None and branch.matcher is not None and branch.matcher.is_stopped():
                reason = "grammar_complete"
            if reason is None and len(output) == settings.max_new_tokens:
                reason = "max_tokens"
            if reason is not None:
                ended[i] = reason
                self.finish_reasons[i] = branch.finish_reason = reason
        if ended:
            self.pending = [i for i in self.pending if i not in ended]
        return ended

    def _stopped(self, generated: list[int], settings: RowSettings) -> str | None:
        """Whether a branch's output just reached EOS ("eos") or completed a stop string ("stop_string")."""
        sampling = settings.sampling
        if generated[-1] in self.parts.inputs.eos_token_ids and not sampling.ignore_eos:
            return "eos"
        window = settings.stop_window
        if window:  # each token is at least one byte, so this window holds any stop string just completed
            tail = self.parts.inputs.detokenize(generated[-window:])
            if any(stop in tail for stop in sampling.stop):
                return "stop_string"
        return None

    # ---- between steps --------------------------------------------------------------------------------
    def event(self, done: StepDone) -> DecodeStep:
        names = [b.name if b is not None else "" for b in self.branches]
        return DecodeStep(done.index, self.max_steps, tuple(names[i] for i in done.rows), tuple(done.tokens),
                          tuple(names[i] for i in done.finished), done.seconds, done.logprobs)

    def drop_pruned(self) -> list[int]:
        """A listener (or, between a batch's steps, another caller) pruned some rows' branches: they leave the
        loop (the others go on). Returns the rows dropped."""
        live, branches = self.parts.tree.branches, self.branches
        dropped = [i for i in self.pending if live.get(branches[i].name) is not branches[i]]
        if dropped:
            self.pending = [i for i in self.pending if i not in dropped]
        return dropped

    def reschedule(self) -> None:
        """Choose the next step's rows and make room for them (at a step boundary: see Preemption.make_room)."""
        self.rows = self.parts.preemption.fit(self.branches, self._choose())

    def _choose(self) -> list[int]:
        """The rows of the next step: all pending ones, or the max_batch of highest priority (re-read every step,
        so a listener can re-rank), ties by tree place so siblings share a batch."""
        pending, limit, resolved = self.pending, self.call.max_batch, self.branches
        if len(pending) <= limit:
            return list(pending)
        if self._tree_rank is None or len(self._tree_rank) < len(resolved):
            self._tree_rank = self._tree_order()
        rank = self._tree_rank
        chosen = sorted(pending, key=lambda i: (-resolved[i].priority, rank[i], i))[:limit]
        return sorted(chosen, key=lambda i: rank[i])

    def _tree_order(self) -> list[int]:
        """Each branch's rank in a depth-first walk of the tree: siblings and cousins rank next to each other."""
        rank = {id(node): r for r, node in enumerate(self.parts.tree.nodes())}
        return [rank.get(id(branch.node), -1) if branch is not None else -1 for branch in self.branches]

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
