"""Continuous batching: one decode loop that branches join and leave between steps (Engine.batch()).

generate() decodes a fixed set of branches until they all stop. A server cannot wait for that: requests arrive
while others decode. A DecodeBatch keeps one DecodeLoop open; `join` adds branches with their own settings
(sampling, token budget, log-probabilities, a constraint) and `step` decodes one token for every row still
running, in one batched forward, so concurrent requests share each step and the tree-aware attention reads their
shared prefix once. A row leaves when it stops (StepDone.ended says why) or when its branch is pruned.

Each join and each step is an engine call of its own (engine_calls.py): between them the engine is free, so other
callers (a notebook forking a branch the batch made, a view reading the tree) get in at step boundaries. One
thread should drive a batch; dendrite_nb/serve/scheduler.py is that thread for the HTTP server.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..constraints import Constraint
from ..engine_calls import engine_call
from ..errors import DendriteError
from ..events import TreeChanged
from ..sampling import SamplingParams
from .decode import MAX_TOP_LOGPROBS, DecodeLoop, GenerateCall, RowSettings, StepDone
from .inputs import BranchRef

if TYPE_CHECKING:
    from .branch_state import Branch
    from .engine import Engine

# A batch decodes every running row each step: the pool, not a row count, is what limits it (preemption makes room).
UNLIMITED_ROWS = 1 << 62


class DecodeBatch:
    """An open decode loop over one engine. Made by Engine.batch()."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._calls = engine._calls   # engine_call runs each method below under the engine's lock and journal
        self._loop = DecodeLoop(engine._decode_parts, GenerateCall([], 1, SamplingParams(), UNLIMITED_ROWS, False))
        self._ended: list[int] = []   # the rows the last step ended: let go of at the next one

    def _emit(self, event: Any) -> None:
        self._engine._emit(event)

    @engine_call
    def join(self, branches: BranchRef | Sequence[BranchRef], max_new_tokens: int,
             sampling: SamplingParams | None = None, constraint: dict[str, Any] | Constraint | None = None,
             logprobs: bool = False, top_logprobs: int = 0) -> list[int]:
        """Add branches to the batch: from the next step on, each decodes up to max_new_tokens more tokens under
        `sampling` (and `constraint`, put on them as generate puts it), keeping each token's log-probability with
        logprobs=True, and reporting the `top_logprobs` most likely tokens per step (StepDone.top_logprobs).
        Checked as generate() checks its arguments; a branch already running in the batch is refused. Returns the
        rows, in order (StepDone numbers rows this way). Bad input raises and changes nothing."""
        engine = self._engine
        sampling = sampling if sampling is not None else SamplingParams()
        constraint = engine._grammars.parse(constraint)
        if not isinstance(logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {logprobs!r}.")
        if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be an int from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs!r}.")
        resolved = engine.check_generate(branches, max_new_tokens, sampling, constraint)
        engine._inputs.check_unique(resolved)
        loop = self._loop
        running = {id(loop.branches[row]) for row in loop.pending}
        busy = [b.name for b in resolved if id(b) in running]
        if busy:
            raise DendriteError(f"branch {busy[0]!r} is decoding in this batch already; wait for it to stop, or "
                                f"fork it and add the fork.")
        return loop.join(resolved, RowSettings(sampling, int(max_new_tokens), logprobs, top_logprobs), constraint)

    @engine_call
    def step(self) -> StepDone | None:
        """Decode one token for each running row, in one batched forward; None when no row is running.
        Rows whose branch was pruned since the last step leave first. The step is committed when it returns;
        a failure undoes only this step (the rows keep their earlier tokens). Ended rows' outputs stay readable
        through `output(row)` until the next step."""
        loop = self._loop
        loop.drop_pruned()
        loop.forget(self._ended)
        self._ended = []
        if not loop.pending:
            return None
        loop.reschedule()
        try:
            done = loop.step()
        except BaseException:
            loop.abort()
            raise
        loop.finish()
        self._ended = list(done.ended)
        engine = self._engine
        if engine._listeners:
            self._calls.deliver(engine._emit, loop.event(done))
        if done.ended:
            names = tuple(loop.branches[row].name for row in done.ended)
            self._calls.events.append(TreeChanged("generate", names))
        return done

    @engine_call
    def leave(self, rows: Sequence[int]) -> None:
        """Stop rows before they end (their caller gave up): they leave at once, keeping the tokens they decoded;
        their branches stay. Rows that ended already are ignored; a row this batch never had is refused."""
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
            raise TypeError(f"leave takes a list of rows (ints join() returned), got {rows!r}.")
        for row in rows:
            self._check_row(row)
        leaving = set(rows)
        self._loop.pending = [row for row in self._loop.pending if row not in leaving]

    @property
    def pending(self) -> int:
        """Rows still running."""
        return len(self._loop.pending)

    @property
    def pending_rows(self) -> frozenset[int]:
        """The rows still running."""
        return frozenset(self._loop.pending)

    def output(self, row: int) -> list[int]:
        """The tokens a row has decoded so far in this batch."""
        return list(self._loop.outputs[self._check_row(row)])

    def branch(self, row: int) -> Branch | None:
        """The branch a row decodes (None once the row has ended and been let go)."""
        return self._loop.branches[self._check_row(row)]

    def _check_row(self, row: Any) -> int:
        """row, if join() gave it; else a ValueError saying which rows there are."""
        count = len(self._loop.branches)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < count:
            rows = f"0 to {count - 1}" if count else "none yet (join() adds branches and returns their rows)"
            raise ValueError(f"row {row!r} is not a row of this batch; its rows are {rows}.")
        return row

    def __repr__(self) -> str:
        return f"DecodeBatch({self.pending} running, {self._loop.steps_done} steps)"
