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
                return _nested(self, calls, method, name, args, kwargs)
            return _outermost(self, calls, method, name, args, kwargs)

    return call  # type: ignore[return-value]


def _outermost(engine: Any, calls: EngineCalls, method: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    journal = calls.journal
    journal.commit()   # changes made outside any call (a test driving the tree by hand) are not ours to undo
    with DeferredInterrupt() as interrupt:
        calls.depth, calls.running, calls.interrupt = 1, name, interrupt
        try:
            result = method(engine, *args, **kwargs)
        except BaseException:
            journal.rollback()
            calls.events.clear()
            raise
        finally:
            calls.depth, calls.running, calls.interrupt = 0, None, None
        journal.commit()
    events, calls.events = calls.events, []
    for event in events:
        engine._emit(event)
    if interrupt.pending:   # Ctrl-C during a call that had no safe point to stop at: it is done, now stop
        raise KeyboardInterrupt
    return result


def _nested(engine: Any, calls: EngineCalls, method: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    if name in NOT_NESTED:
        raise DendriteError(f"{name}() cannot run while {calls.running}() is running (from a listener, say); "
                            f"call it after {calls.running}() returns.")
    mark, queued = calls.journal.mark(), len(calls.events)
    calls.depth += 1
    try:
        result = method(engine, *args, **kwargs)
    except BaseException:
        calls.journal.rollback(mark)
        del calls.events[queued:]
        raise
    finally:
        calls.depth -= 1
    if calls.listening:
        events = calls.events[queued:]
        del calls.events[queued:]
        for event in events:
            calls.deliver(engine._emit, event)
    return result


@contextlib.contextmanager
def atomic_calls(engine: Any) -> Iterator[None]:
    """Engine.atomic(): the calls made in the block are one call, under the same guarantees (one owner, all or
    nothing, Ctrl-C at safe points, events after commit). generate() is not one of them (it commits each step)."""
    calls: EngineCalls = engine._calls
    with calls.lock:
        if calls.depth:   # inside a call already: a nested part of it
            mark, queued = calls.journal.mark(), len(calls.events)
            calls.depth += 1
            try:
                yield
            except BaseException:
                calls.journal.rollback(mark)
                del calls.events[queued:]
                raise
            finally:
                calls.depth -= 1
            return
        journal = calls.journal
        journal.commit()
        with DeferredInterrupt() as interrupt:
            calls.depth, calls.running, calls.interrupt = 1, "atomic", interrupt
            try:
                yield
            except BaseException:
                journal.rollback()
                calls.events.clear()
                raise
            finally:
                calls.depth, calls.running, calls.interrupt = 0, None, None
            journal.commit()
        events, calls.events = calls.events, []
        for event in events:
            engine._emit(event)
        if interrupt.pending:
            raise KeyboardInterrupt
