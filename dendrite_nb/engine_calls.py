"""One engine call at a time, each one all or nothing, and Ctrl-C only where it is safe.

Every public Engine method runs through `engine_call`, which gives it four guarantees:

- **One owner.** The call holds the engine's lock, so a call from a second thread waits until the running one
  ends: the tree, the KV pool and the CUDA graphs are never used by two threads at once. Listeners run on the
  calling thread and may call the engine again (a nested call, which the lock lets through).
- **All or nothing.** Every change to the tree and the allocator is logged in the journal (kv/journal.py)
  before it is made. If the call raises, whatever the exception and wherever it lands, the journal is rolled
  back and the tree, the refcounts and the free blocks are exactly as they were; if it returns, the journal is
  committed. generate() commits after each decode step, so a failure loses only the step it interrupted.
- **Ctrl-C at safe points.** The outermost call defers SIGINT (interrupts.py). A prefill stops between
  chunks (and is undone), generate() stops after the current step (GenerationInterrupted keeps the steps
  done); any other call finishes, and KeyboardInterrupt is raised as it returns. An interrupt is never dropped.
- **Events after the fact.** A call's TreeChanged events reach listeners once the call has committed, so a
  listener never sees a half-made change, and one that raises cannot undo the change it was told about.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, TypeVar

from .errors import DendriteError
from .events import Event
from .interrupts import DeferredInterrupt
from .kv.journal import Journal

# Calls a listener may not make while another call runs: a nested generate (or a batch's step) would decode
# branches the running one is decoding, and close would free the pool under it.
NOT_NESTED = frozenset({"generate", "step", "close"})

Method = TypeVar("Method", bound=Callable[..., Any])


class EngineCalls:
    """The state behind engine_call: the lock, the depth of nesting, the pending interrupt and events."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self.lock = threading.RLock()
        self.depth = 0
        self.running: str | None = None   # the outermost call, by name
        self.interrupt: DeferredInterrupt | None = None
        self.events: list[Event] = []     # TreeChanged events waiting for their call to commit
        # True while generate delivers a step's events: the step is committed, so what a listener's calls
        # change stays done at once (and their events go out at once), whatever the running call does next.
        self.listening = False

    def check_interrupt(self) -> None:
        """Raise KeyboardInterrupt here if Ctrl-C arrived during the call (once: it is then handled)."""
        interrupt = self.interrupt
        if interrupt is not None and interrupt.pending:
            interrupt.pending = False
            raise KeyboardInterrupt

    def deliver(self, emit: Callable[[Event], None], event: Event) -> None:
        """Give `event` to the listeners now, from a committed point of a running call."""
        self.listening, was = True, self.listening
        try:
            emit(event)
        finally:
            self.listening = was
            self.journal.commit()   # what listeners did stays done, even when one of them raised


def engine_call(method: Method) -> Method:
    """Run an Engine method under the guarantees above (the engine holds an EngineCalls as `_calls`)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        calls: EngineCalls = self._calls
        with calls.lock:
            if calls.depth:
                if name in NOT_NESTED:
                    raise DendriteError(f"{name}() cannot run while {calls.running}() is running (from a listener, "
                                        f"say); call it after {calls.running}() returns.")
                with _Nested(self, calls):
                    return method(self, *args, **kwargs)
            with _Outermost(self, calls, name):
                return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


@contextlib.contextmanager
def atomic_calls(engine: Any) -> Iterator[None]:
    """Engine.atomic(): the calls made in the block are one call, under the same guarantees (one owner, all or
    nothing, Ctrl-C at safe points, events after commit). generate() is not one of them (it commits each step)."""
    calls: EngineCalls = engine._calls
    with calls.lock:
        with _Nested(engine, calls) if calls.depth else _Outermost(engine, calls, "atomic"):
            yield


class _Outermost:
    """The scope of a call that no other call runs around: the journal is rolled back if it raises and committed
    if it returns, Ctrl-C waits for its end (or a safe point inside it), and its events go out once it committed."""

    __slots__ = ("engine", "calls", "name", "interrupt")

    def __init__(self, engine: Any, calls: EngineCalls, name: str):
        self.engine, self.calls, self.name = engine, calls, name

    def __enter__(self) -> None:
        calls = self.calls
        calls.journal.commit()   # changes made outside any call (a test driving the tree by hand) are not ours to undo
        self.interrupt = DeferredInterrupt().__enter__()
        calls.depth, calls.running, calls.interrupt = 1, self.name, self.interrupt

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        calls, interrupt = self.calls, self.interrupt
        try:
            if kind is not None:
                try:
                    calls.journal.rollback()
                    calls.events.clear()
                finally:
                    calls.depth, calls.running, calls.interrupt = 0, None, None
                return False
            calls.depth, calls.running, calls.interrupt = 0, None, None
            calls.journal.commit()
        finally:
            interrupt.__exit__(None, None, None)
        events, calls.events = calls.events, []
        for event in events:
            self.engine._emit(event)
        if interrupt.pending:   # Ctrl-C during a call that had no safe point to stop at: it is done, now stop
            raise KeyboardInterrupt
        return False


class _Nested:
    """The scope of a call made inside another (by the engine itself, or by a listener): undone alone if it raises;
    its events go out at once when a listener made it (the running call is at a committed point then)."""

    __slots__ = ("engine", "calls", "mark", "queued")

    def __init__(self, engine: Any, calls: EngineCalls):
        self.engine, self.calls = engine, calls

    def __enter__(self) -> None:
        calls = self.calls
        self.mark, self.queued = calls.journal.mark(), len(calls.events)
        calls.depth += 1

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        calls, queued = self.calls, self.queued
        try:
            if kind is not None:
                calls.journal.rollback(self.mark)
                del calls.events[queued:]
                return False
        finally:
            calls.depth -= 1
        if calls.listening:
            events = calls.events[queued:]
            del calls.events[queued:]
            for event in events:
                calls.deliver(self.engine._emit, event)
        return False
