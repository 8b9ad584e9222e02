"""Coalesce engine events into at most one view update per interval.

The engine calls listeners synchronously after every decode step. A view that redrew on each of them
would send 2,000 messages for a 2,000-step generation; the feed instead records cheap per-event state
at once and sends the coalesced state at most every `interval_s`, plus once when a generation ends
(so the final state is never left behind) and once after the notebook cell finishes (for bursts of
forks or prunes that the throttle held back). An update that takes long widens the gap before the
next one (MAX_TIME_SHARE), so a view never slows a generation by more than a few percent.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

from dendrite_nb import Engine, TreeChanged
from dendrite_nb.events import Event

DEFAULT_INTERVAL_S = 0.1   # about 10 updates per second: smooth to the eye, cheap for the front end
MAX_TIME_SHARE = 0.05      # a view whose updates are slow (a large pool) updates less often, so that it
MAX_GAP_S = 2.0            # takes at most ~5% of the engine's time, yet at least every 2 seconds


class ThrottledFeed:
    def __init__(self, engine: Engine, flush: Callable[[], None], note: Callable[[Event], None] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 seconds, got {interval_s!r}.")
        self._flush, self._note, self.interval_s, self._clock = flush, note, interval_s, clock
        self.pending = False
        self.flushes = 0
        self.error: str | None = None     # the last failure of a flush, kept instead of breaking the engine
        self._last_flush_s = float("-inf")
        self.gap_s = interval_s            # the current minimum time between updates
        self._subscription = engine.subscribe(self._on_event)
        self._cell_hook = _register_post_cell(self.flush)

    def _on_event(self, event: Event) -> None:
        if self._note is not None:
            self._note(event)
        self.pending = True
        generation_ended = isinstance(event, TreeChanged) and event.reason == "generate"
        if generation_ended or self._clock() - self._last_flush_s >= self.gap_s:
            self.flush()

    def flush(self, *_) -> None:
        """Send the coalesced state now if anything changed since the last send."""
        if not self.pending:
            return
        self.pending = False
        started = self._clock()
        self.flushes += 1
        try:
            self._flush()
        except Exception as exc:  # a view must never stop a generation; say so once and keep going
            if self.error is None:
                warnings.warn(f"a dendrite view failed to update and shows stale data: {exc!r}", stacklevel=2)
            self.error = repr(exc)
        finally:
            self._last_flush_s = self._clock()
            cost_s = self._last_flush_s - started
            self.gap_s = min(MAX_GAP_S, max(self.interval_s, cost_s / MAX_TIME_SHARE))

    def close(self) -> None:
        self._subscription.close()
        if self._cell_hook is not None:
            self._cell_hook()
            self._cell_hook = None


def _register_post_cell(callback: Callable[..., None]) -> Callable[[], None] | None:
    """Run `callback` after every cell when inside IPython; returns the unregister function."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None:
        return None
    shell.events.register("post_run_cell", callback)
    return lambda: shell.events.unregister("post_run_cell", callback)
