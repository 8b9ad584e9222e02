"""The engine thread: one thread owns the engine (and its GPU) and runs every request's work on it.

HTTP handlers (and a notebook's `%gen` while the server runs) only enqueue jobs and read updates. Between two
decode steps the thread runs queued calls (a prune, a snapshot), admits waiting jobs that the pool has room for
(each job prefills its branches, then joins the running batch: engine/batch.py), and then decodes one token for
every running row in one batched forward. So requests join and leave the batch between steps, and concurrent
requests share each forward.

Admission keeps memory honest: a job reserves the blocks its rows may still take (prompt and token budget), and
waits in a bounded queue while the pool (free blocks plus evictable cache) cannot hold it; past the bound, submit
refuses (the server answers 429). A job that could never fit is refused at once. Nothing admitted is dropped for
want of memory.
"""
from __future__ import annotations

import collections
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from ..constraints import Constraint
from ..errors import DendriteError
from ..sampling import SamplingParams


class QueueFull(DendriteError):
    """The scheduler's waiting line is full; retry later (HTTP 429)."""


class SchedulerStopped(DendriteError):
    """The scheduler was stopped (the server is shutting down)."""


@dataclass(frozen=True)
class Prepared:
    """What a job's prepare step made on the engine thread: branches to decode, and how."""

    branches: list[Any]            # engine Branches, one per choice
    max_new_tokens: int
    sampling: SamplingParams
    constraint: Constraint | dict | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    info: dict[str, Any] = field(default_factory=dict)   # whatever the job wants back (prompt and cached tokens)


@dataclass(frozen=True)
class Update:
    """What one step did for one job, delivered to its sink on the engine thread. kind:
    "started" (info), "tokens" (by choice: token, logprob or None, top alternatives or None), "ended" (reasons:
    choice -> finish reason), then one of "done", "failed" (error) or "cancelled" (its rows have left the batch,
    after cancel()), which is the job's last update."""

    kind: str
    info: dict[str, Any] | None = None
    tokens: dict[int, tuple[int, float | None, list[tuple[int, float]] | None]] | None = None
    reasons: dict[int, str] | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Job:
    """One request. prepare(engine) runs on the engine thread and returns Prepared (it must leave the engine as it
    was if it raises); abandon(engine, prepared) undoes it when the job is cancelled or fails after it (prunes the
    branches); complete(engine, prepared) runs when its rows have all ended (the server keeps the response).
    sink(update) must be cheap and thread-safe: it runs on the engine thread."""

    prepare: Callable[[Any], Prepared]
    sink: Callable[[Update], None]
    blocks_needed: int                       # KV blocks the job may take, at most (prompt and every token budget)
    abandon: Callable[[Any, Prepared], None] | None = None
    complete: Callable[[Any, Prepared], None] | None = None   # on the engine thread, once every row ended
    cancelled: bool = False
    prepared: Prepared | None = None
    rows: dict[int, int] = field(default_factory=dict)   # batch row -> choice index, while running
    reserved: int = 0


class Scheduler:
    """Owns the engine thread. `submit` jobs, `call` functions on the engine between steps, `stop` at the end."""

    def __init__(self, engine: Any, max_waiting: int = 256,
                 on_pressure: Callable[[int], int] | None = None):
        """max_waiting: jobs that may wait for room before submit refuses. on_pressure(blocks): called on the
        engine thread when a waiting job needs `blocks` more than the pool has; it may free some (prune retained
        responses) and returns how many it freed."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_pressure = on_pressure
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[Any], Any], Future]] = collections.deque()
        self._running: list[Job] = []
        self._stopping = False
        self._batch = None
        self._thread: threading.Thread | None = None
        self.steps = 0          # decode steps run
        self.max_rows_seen = 0  # the largest batch a step decoded

    # ---- from any thread ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise DendriteError("this scheduler is running already.")
        self._batch = self.engine.batch()
        self._thread = threading.Thread(target=self._run, name="dendrite-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job. Raises QueueFull when max_waiting jobs wait already, DendriteError when the job could never
        fit the pool, SchedulerStopped after stop()."""
        capacity = self.engine.num_blocks
        if job.blocks_needed > capacity:
            raise DendriteError(f"this request needs up to {job.blocks_needed:,} KV blocks and the pool holds "
                                f"{capacity:,} in all; ask for fewer tokens or fewer choices.")
        with self._cond:
            if self._stopping:
                raise SchedulerStopped("the server is shutting down.")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for room already; retry shortly.")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client went away, or Ctrl-C): queued, it is dropped; running, its rows leave the batch at
        the next step boundary, and job.abandon (if any) frees its branches."""
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    def call(self, function: Callable[[Any], Any]) -> Future:
        """Run function(engine) on the engine thread between steps; its result (or error) in the Future."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise SchedulerStopped("the server is shutting down.")
            self._calls.append((function, future))
            self._cond.notify()
        return future

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread at the next step boundary. Waiting and running jobs get a "failed" update
        (SchedulerStopped) and are abandoned; the engine stays usable."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ---- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._calls or self._batch.pending or self._has_work()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    calls, self._calls = list(self._calls), collections.deque()
                for function, future in calls:
                    self._run_call(function, future)
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._step()
        finally:
            self._shut_down()

    def _has_work(self) -> bool:
        """Under the lock: a cancelled job to clean up, or a waiting job (admission decides whether it fits)."""
        return any(job.cancelled for job in self._running) or bool(self._waiting) and self._can_try_admit

    _can_try_admit = True   # False while the head job waits for rows to end (nothing new can make room)

    def _run_call(self, function: Callable[[Any], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(self.engine))
        except BaseException as error:   # the caller's to see; the engine call undid itself
            future.set_exception(error)

    def _drop_cancelled(self) -> None:
        with self._cond:
            queued = [job for job in self._waiting if job.cancelled]
            for job in queued:
                self._waiting.remove(job)
        for job in queued:
            job.sink(Update("cancelled"))
        for job in [job for job in self._running if job.cancelled]:
            self._finish(job, None)

    def _reserved(self) -> int:
        """Blocks the running jobs may still take."""
        return sum(job.reserved for job in self._running)

    def _room(self) -> int:
        engine = self.engine
        return engine.num_free_blocks + engine.num_cached_blocks - self._reserved()

    def _admit(self) -> None:
        """Admit waiting jobs in order while the pool can hold them (the first that does not fit waits: no job is
        passed over for ever by smaller ones)."""
        while True:
            with self._cond:
                if not self._waiting:
                    self._can_try_admit = True
                    return
                job = self._waiting[0]
            short = job.blocks_needed - self._room()
            if short > 0 and self.on_pressure is not None:
                self.on_pressure(short)
                short = job.blocks_needed - self._room()
            if short > 0:
                if self._running:
                    self._can_try_admit = False   # rows ending will make room: wait for them
                    return
                # Nothing runs and it still does not fit: what holds the pool is not ours to free.
                with self._cond:
                    self._waiting.popleft()
                job.sink(Update("failed", error=DendriteError(
                    f"the KV pool has room for {max(0, self._room()):,} more blocks and this request needs up to "
                    f"{job.blocks_needed:,}; free some branches (or responses) and retry.")))
                continue
            with self._cond:
                self._waiting.popleft()
            self._start(job)

    def _start(self, job: Job) -> None:
        engine = self.engine
        try:
            prepared = job.prepare(engine)
        except BaseException as error:   # prepare left the engine as it was
            job.sink(Update("failed", error=error))
            return
        job.prepared = prepared
        try:
            rows = self._batch.join(prepared.branches, prepared.max_new_tokens, prepared.sampling,
                                    prepared.constraint, prepared.logprobs, prepared.top_logprobs)
        except BaseException as error:
            self._abandon(job)
            job.sink(Update("failed", error=error))
            return
        job.rows = {row: choice for choice, row in enumerate(rows)}
        job.reserved = job.blocks_needed
        self._running.append(job)
        job.sink(Update("started", info=prepared.info))

    def _step(self) -> None:
        try:
            done = self._batch.step()
        except BaseException as error:   # the step undid itself; the rows it held cannot go on reliably
            traceback.print_exc()
            for job in list(self._running):
                self._finish(job, error)
            return
        self._can_try_admit = True
        if done is not None:
            self.steps += 1
            self.max_rows_seen = max(self.max_rows_seen, len(done.rows))
        by_row = {row: n for n, row in enumerate(done.rows)} if done is not None else {}
        ended = done.ended if done is not None else {}
        pending = self._batch.pending_rows
        block_size = self.engine.block_size
        for job in list(self._running):
            tokens = {}
            for row, choice in job.rows.items():
                n = by_row.get(row)
                if n is not None:
                    logprob = done.logprobs[n] if done.logprobs is not None else None
                    top = done.top_logprobs[n] if done.top_logprobs is not None else None
                    tokens[choice] = (done.tokens[n], logprob, top)
            if tokens:
                # The reservation shrinks by what the rows took: at most a block per block_size tokens each.
                job.reserved = max(0, job.reserved - -(-len(tokens) // block_size))
                job.sink(Update("tokens", tokens=tokens))
            # A row leaves when it stops, or when someone pruned its branch (a notebook, a DELETE).
            reasons = {choice: ended.get(row, "pruned") for row, choice in job.rows.items()
                       if row in ended or row not in pending}
            if reasons:
                job.rows = {row: choice for row, choice in job.rows.items() if choice not in reasons}
                job.sink(Update("ended", reasons=reasons))
            if not job.rows:
                self._running.remove(job)
                job.reserved = 0
                if job.complete is not None:
                    try:
                        job.complete(self.engine, job.prepared)
                    except Exception:   # keeping a finished response is a courtesy: the reply still goes out
                        traceback.print_exc()
                job.sink(Update("done"))

    def _finish(self, job: Job, error: BaseException | None) -> None:
        """A job leaves for good before its rows ended: cancelled (error None) or failed. Its rows stop; a job with
        an abandon step has its branches freed, one without keeps them with the tokens decoded so far."""
        if job in self._running:
            self._running.remove(job)
        if job.rows:
            self._batch.leave(list(job.rows))
        self._abandon(job)
        job.sink(Update("failed", error=error) if error is not None else Update("cancelled"))

    def _abandon(self, job: Job) -> None:
        if job.abandon is not None and job.prepared is not None:
            try:
                job.abandon(self.engine, job.prepared)
            except Exception:   # a branch a notebook pruned already, say: nothing more to free
                traceback.print_exc()
        job.rows, job.reserved = {}, 0

    def _shut_down(self) -> None:
        stopped = SchedulerStopped("the server is shutting down.")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
            self._stopping = True
        for job in waiting:
            job.sink(Update("failed", error=stopped))
        for job in list(self._running):
            self._finish(job, stopped)
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(stopped)
