"""Per-step timings of the latest generate call: what throughput views and reports plot.

A StepHistory is an engine listener (`engine.subscribe(history)`). It keeps flat arrays rather than
one object per step, so a 2,000-step, 64-branch generation costs two appends per step and the arrays
can be sent to a browser as raw bytes.
"""
from __future__ import annotations

from array import array

from .events import DecodeStep, Event
from .wording import counted


class StepHistory:
    def __init__(self):
        self.calls = 0                      # generate calls seen; the arrays hold the last one
        self.step_s = array("d")            # wall time of each step of the last call, seconds
        self.batch_sizes = array("I")       # branches decoded in each step of the last call

    def __call__(self, event: Event) -> None:
        if not isinstance(event, DecodeStep):
            return
        if event.step == 0:
            self.calls += 1
            self.step_s, self.batch_sizes = array("d"), array("I")
        self.step_s.append(event.step_s)
        self.batch_sizes.append(event.batch_size)

    def __len__(self) -> int:
        return len(self.step_s)

    @property
    def total_s(self) -> float:
        return sum(self.step_s)

    @property
    def total_tokens(self) -> int:
        return sum(self.batch_sizes)

    def summary(self) -> str:
        if not self.step_s:
            return "no decode steps yet; run a generation first"
        seconds, tokens = self.total_s, self.total_tokens
        rate = f"{tokens / seconds:,.0f} tok/s" if seconds > 0 else "no measurable time"
        return (f"last generation: {counted(len(self), 'step')}, {counted(tokens, 'token')} in {seconds:.2f} s "
                f"({rate}; mean step {1e3 * seconds / len(self):.1f} ms)")

    def __repr__(self) -> str:
        return f"StepHistory({self.summary()})"
