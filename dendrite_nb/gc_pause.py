"""Keep Python's cyclic garbage collector off the objects that exist before a generation starts.

A process that has imported torch and transformers holds about 400,000 objects the collector tracks
(functions, types, module dicts). A full collection walks all of them: 180 ms on the CI CPU. A decode
step of many branches makes thousands of short-lived containers (append records, segments, row views),
and some live long enough to count towards the next full collection, so at 1,000 branches one ran about
every 20 steps and doubled the mean step time (benchmarks/REPORT.md).

While a generation runs, the objects older than it are moved to the collector's permanent generation
(gc.freeze): collections then walk only what the generation made. They go back when it ends
(gc.unfreeze), so nothing is kept from the collector for longer than the call. Garbage among them that
only the cyclic collector can free waits until then; anything freed by reference counting goes at once.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # generations running now (a listener may start another); the outermost freezes and unfreezes
_ours = False  # whether the outermost froze the heap (it leaves a heap that someone else froze alone)


@contextlib.contextmanager
def older_objects_frozen():
    global _depth, _ours
    with _lock:
        if _depth == 0:
            _ours = gc.isenabled() and gc.get_freeze_count() == 0
            if _ours:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _ours:
                gc.unfreeze()
                _ours = False
