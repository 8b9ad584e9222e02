"""Turn Ctrl-C (Jupyter's Kernel > Interrupt sends SIGINT) into a stop at the next step boundary.

Python raises KeyboardInterrupt wherever the signal lands, which could be between two bookkeeping
writes of the block allocator. While a generation runs, the SIGINT handler only records the signal;
the decode loop checks it after each completed step and raises there, so the tree, the refcounts and
the free list are always consistent. Outside the main thread (where handlers cannot be installed)
the default behaviour stays, and the per-step undo still keeps the state consistent.
"""
from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """Context manager: while active, SIGINT sets `.pending` instead of raising."""

    def __init__(self):
        self.pending = False
        self._previous = None  # the handler to restore; None while ours is not installed

    def _record(self, signum, frame) -> None:
        self.pending = True

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            # Only replace Python's own KeyboardInterrupt handler: a handler somebody else
            # installed on purpose (or SIG_IGN) is theirs to keep.
            if previous is signal.default_int_handler:
                self._previous = previous
                signal.signal(signal.SIGINT, self._record)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
