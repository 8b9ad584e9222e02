"""%gen while the kernel's server runs: the notebook's branches decode in the server's batch (issue 41, item 3).

While the server runs, its engine thread (dendrite_nb.serve.scheduler) drives the decode loop. engine.generate
from the notebook would hold the engine for its whole call and stall every request; instead the magic submits a
Job whose rows join the running batch between two steps, so the notebook's branches and the HTTP requests share
each batched forward. The branches are the user's: the job has no abandon step, so a cancelled job's branches keep
the tokens they decoded, as generate's branches keep them on Ctrl-C.

The engine thread only puts the job's updates on a queue; the magic's thread takes them off and draws them, so
the cell's output is written from the thread that runs the cell.
"""
from __future__ import annotations

import queue
import time
from typing import Any

from dendrite_nb import Branch, Constraint, DendriteError, Engine, GenerationInterrupted, SamplingParams

from .live import LiveGeneration

FINISHED_EARLY = frozenset({"eos", "stop_string", "grammar_complete"})   # reasons the live view marks with ✓
WAIT_S = 0.1                 # one wait for an update: short, so a stopped server is noticed
STEP_BOUNDARY_WAIT_S = 120.0  # at most one decode step of the largest model, to stop at its end


class _Progress:
    """What the job's updates have brought so far: each branch's new tokens, and the steps."""

    def __init__(self, names: list[str], live: LiveGeneration):
        self.names, self.live = names, live
        self.outputs: list[list[int]] = [[] for _ in names]
        self.steps = 0

    def take(self, update: Any) -> None:
        if update.kind == "tokens":
            self.steps += 1
            new = {}
            for choice, (token, _, _) in update.tokens.items():
                self.outputs[choice].append(token)
                new[self.names[choice]] = token
            self.live.record(new, (), self.steps)
        elif update.kind == "ended":
            early = [self.names[choice] for choice, reason in update.reasons.items() if reason in FINISHED_EARLY]
            self.live.record({}, early, self.steps)


def decode_in_server_batch(scheduler: Any, engine: Engine, branches: list[Branch], max_tokens: int,
                           sampling: SamplingParams, constraint: Constraint | None, logprobs: bool,
                           live: LiveGeneration) -> list[list[int]]:
    """Decode `branches` (checked by Engine.check_generate) in the server's batch, drawing each step in `live`;
    returns the new tokens per branch. Ctrl-C stops the rows at the next step boundary and raises
    GenerationInterrupted with the tokens they kept; the job's failure is raised as it came."""
    from dendrite_nb.serve.scheduler import Job, Prepared

    updates: queue.SimpleQueue = queue.SimpleQueue()
    blocks = len(branches) * (-(-max_tokens // engine.block_size) + 1)   # +1: a copy-on-write block each
    prepared = Prepared(list(branches), max_tokens, sampling, constraint, logprobs)
    job = Job(prepare=lambda _engine: prepared, sink=updates.put, blocks_needed=blocks)
    progress = _Progress([b.name for b in branches], live)
    try:
        scheduler.submit(job)
        while True:
            update = _next_update(scheduler, updates)
            if update.kind == "failed":
                raise update.error
            progress.take(update)
            if update.kind == "done":
                return progress.outputs
    except KeyboardInterrupt as interrupt:
        scheduler.cancel(job)
        _take_until_last(scheduler, updates, progress)
        raise GenerationInterrupted(progress.outputs, progress.steps, max_tokens) from interrupt


def _next_update(scheduler: Any, updates: queue.SimpleQueue) -> Any:
    while True:
        try:
            return updates.get(timeout=WAIT_S)
        except queue.Empty:
            if not scheduler.running and updates.empty():   # stopped without a word for this job
                raise DendriteError("the kernel's server stopped while this cell waited for its tokens; "
                                    "the branches keep those decoded so far.") from None


def _take_until_last(scheduler: Any, updates: queue.SimpleQueue, progress: Any) -> None:
    """After a cancel: take the updates of the steps that ended before the rows left, up to the job's last one
    ("cancelled", or "done" / "failed" when it ended first). A stopped server says nothing more: its rows left
    with it."""
    deadline = time.monotonic() + STEP_BOUNDARY_WAIT_S
    while time.monotonic() < deadline:
        try:
            update = updates.get(timeout=WAIT_S)
        except queue.Empty:
            if not scheduler.running:
                return
            continue
        if update.kind in ("cancelled", "done", "failed"):
            return
        progress.take(update)
