"""ThroughputView: decode tokens/s, step time and batch size per step of the latest generation, live (plotly)."""
from __future__ import annotations

from typing import Any

import traitlets
from ipywidgets import widget_serialization

from dendrite_nb import StepHistory
from dendrite_nb.events import Event

from .engine_view import EngineView, view_module
from .plotly_library import PlotlyLibrary, plotly_library


class ThroughputView(EngineView):
    """Three stacked plots sharing the step axis: tokens/s, step time (ms) and batch size. Pass the
    `history` an owner already records (the notebook session does) to show steps from before the
    view existed; otherwise the view records its own from now on."""

    _esm = view_module("throughput.js")
    _plotly = traitlets.Instance(PlotlyLibrary).tag(sync=True, **widget_serialization)
    _call = traitlets.Int(0).tag(sync=True)               # which generate call the arrays belong to
    _step_s = traitlets.Bytes(b"").tag(sync=True)         # float64 [steps]: wall time per step, seconds
    _batch_sizes = traitlets.Bytes(b"").tag(sync=True)    # uint32 [steps]: branches decoded per step
    _summary = traitlets.Unicode("").tag(sync=True)

    def __init__(self, engine, history: StepHistory | None = None, **kwargs):
        self._owns_history = history is None
        self.history = StepHistory() if history is None else history
        super().__init__(engine, _plotly=plotly_library(), **kwargs)

    def _note(self, event: Event) -> None:
        if self._owns_history:   # a shared history is fed by its owner's own subscription
            self.history(event)

    def _state(self) -> dict[str, Any]:
        history = self.history
        return {"_call": history.calls, "_step_s": history.step_s.tobytes(),
                "_batch_sizes": history.batch_sizes.tobytes(), "_summary": history.summary()}

    def __repr__(self) -> str:
        return self.history.summary()
