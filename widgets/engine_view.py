"""The base of the live views: an anywidget bound to one engine through a throttled feed."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import anywidget
import traitlets

from dendrite_nb import Engine
from dendrite_nb.events import Event

from .feed import DEFAULT_INTERVAL_S, ThrottledFeed

STATIC = Path(__file__).parent / "static"


def view_module(name: str) -> str:
    """A view's ESM source: the shared helpers in common.js, then the view's own file."""
    return (STATIC / "common.js").read_text(encoding="utf-8") + (STATIC / name).read_text(encoding="utf-8")


class EngineView(anywidget.AnyWidget):
    """Subclasses set `_esm` and implement `_state` (the synced traits' values for the engine's state
    now, computed without side effects) and optionally `_note` (cheap per-event bookkeeping). The
    first state travels with the widget's comm_open; each later one is a single update message."""

    _css = STATIC / "views.css"
    _error = traitlets.Unicode("").tag(sync=True)   # shown in the view when an update failed

    def __init__(self, engine: Engine, *, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, **kwargs):
        if not isinstance(engine, Engine):
            raise TypeError(f"a view needs a dendrite_nb.Engine, got {type(engine).__name__}.")
        if engine.closed:
            raise ValueError("this engine was closed; make the view from the engine that replaced it.")
        self._engine = engine
        self._feed = ThrottledFeed(engine, self._push, self._note, interval_s, clock)
        try:
            super().__init__(**self._state(), **kwargs)
        except BaseException:
            self._feed.close()
            raise

    def refresh(self) -> None:
        """Push the engine's current state now, regardless of the throttle."""
        self._push()

    def _push(self) -> None:
        try:
            state = self._state()
        except Exception as exc:
            self._error = repr(exc)   # the view says it is stale; the feed warns once
            raise
        state["_error"] = ""
        with self.hold_sync():
            for name, value in state.items():
                setattr(self, name, value)

    def _live_branch(self, name: str | None, verb: str) -> str | None:
        """`name` if it is None or a live branch; otherwise a TraitError that lists the branches."""
        if name is not None and name not in self._engine.branches:
            raise traitlets.TraitError(f"there is no branch {name!r} to {verb}; the branches are: "
                                       f"{', '.join(sorted(self._engine.branches)) or 'none'}.")
        return name

    def _note(self, event: Event) -> None:
        pass

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop listening to the engine and close the front-end views."""
        feed = getattr(self, "_feed", None)   # absent when __init__ refused its arguments
        if feed is not None:
            feed.close()
        super().close()
