"""Fault injection, SQLite style: raise an exception at the n-th executed line of dendrite-nb code in a call.

`LineFault(n, exception)` traces every frame of the dendrite_nb package (comprehensions and the model's
forward included), counts executed lines, and raises at the n-th, once. The transaction machinery itself
(engine_calls.py, kv/journal.py, interrupts.py) is not traced: it is what must survive the fault, as
SQLite's own rollback is not where SQLite injects. `count_lines(call)` runs a call under the same counter.

A sweep (sweep.py beside this) injects at every line of an operation, or at a seeded sample of them, and
checks that no damage was left.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

PACKAGE = Path(__file__).resolve().parent.parent
MACHINERY = {PACKAGE / "engine_calls.py", PACKAGE / "kv" / "journal.py", PACKAGE / "interrupts.py",
             PACKAGE / "testing" / "faults.py", PACKAGE / "testing" / "sweep.py"}


def _traced(filename: str, cache: dict[str, bool] = {}) -> bool:
    """Whether a code object's file is dendrite-nb code a fault may land in."""
    known = cache.get(filename)
    if known is None:
        path = Path(filename).resolve()
        known = cache[filename] = path.is_relative_to(PACKAGE) and path not in MACHINERY
    return known


class LineFault:
    """Context manager: raise `exception` (a class or an instance) at the `at`-th executed traced line.
    `.count` is the lines executed while active; `.fired` whether the fault was raised."""

    def __init__(self, at: int | None, exception: type[BaseException] | BaseException = RuntimeError):
        self.at, self.exception = at, exception
        self.count, self.fired = 0, False
        self._previous = None

    def _global(self, frame, event: str, arg: Any):
        if self.fired or not _traced(frame.f_code.co_filename):
            return None
        return self._local

    def _local(self, frame, event: str, arg: Any):
        if self.fired:
            return None
        if event == "line":
            self.count += 1
            if self.count == self.at:
                self.fired = True
                sys.settrace(None)   # one fault per run: what the rollback does is not injected into
                exception = self.exception
                raise exception if isinstance(exception, BaseException) else exception(
                    f"injected fault at traced line {self.at} ({Path(frame.f_code.co_filename).name}:"
                    f"{frame.f_lineno})")
        return self._local

    def __enter__(self) -> LineFault:
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self._previous)


def count_lines(call: Callable[[], Any]) -> int:
    """Traced lines one run of `call` executes."""
    with LineFault(None) as counter:
        call()
    return counter.count
