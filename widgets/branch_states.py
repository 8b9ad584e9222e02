"""Which branches are decoding, which finished (EOS or a stop string), which are idle, from engine events."""
from __future__ import annotations

from dendrite_nb import DecodeStep, TreeChanged
from dendrite_nb.events import Event

STATES = ("idle", "decoding", "finished")   # the tree view's colour legend, in this order


class BranchStates:
    def __init__(self):
        self.decoding: set[str] = set()
        self.finished: set[str] = set()

    def __call__(self, event: Event) -> None:
        if isinstance(event, DecodeStep):
            if event.step == 0:
                self.finished.difference_update(event.branches)  # a new generation restarts them
            self.decoding = set(event.branches) - set(event.finished)
            self.finished.update(event.finished)
        elif isinstance(event, TreeChanged):
            if event.reason == "generate":
                self.decoding.clear()
            elif event.reason in ("prune", "append", "rewind"):
                self.finished.difference_update(event.branches)
                self.decoding.difference_update(event.branches)

    def state(self, name: str) -> str:
        if name in self.decoding:
            return "decoding"
        return "finished" if name in self.finished else "idle"
