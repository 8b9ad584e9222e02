"""Streaming a generation into the cell's output: one line per branch, updated in place, with a progress bar.

The view listens to the engine's DecodeStep events (or, while the kernel's server decodes, is fed the server's
updates: server_gen.py) and redraws through one display handle, at most every `min_interval_s`, so a long
generation over many branches does not flood the front end. When the generation ends the view collapses to a
one-line summary; the full texts are the magic's result.
"""
from __future__ import annotations

import html
import time
from typing import Iterable

from IPython.display import display

from dendrite_nb import Branch, DecodeStep, Engine
from dendrite_nb.wording import counted

from .results import one_line

MAX_LINES = 64           # branches shown while running; the rest are counted
LINE_WIDTH = 100         # characters of each branch's newest text
BAR_WIDTH = 30


class LiveGeneration:
    def __init__(self, engine: Engine, branches: list[Branch], max_steps: int, min_interval_s: float = 0.1):
        self._engine = engine
        self.names = [b.name for b in branches]
        self.tokens: dict[str, list[int]] = {name: [] for name in self.names}
        self.finished: set[str] = set()
        self.max_steps, self.min_interval_s = max_steps, min_interval_s
        self.steps = 0
        self.state = "running"   # then "done" or "interrupted"
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.redraws = 0
        self._last_redraw = 0.0
        self.handle = display(self, display_id=True)

    def __call__(self, event) -> None:
        if isinstance(event, DecodeStep):
            self.record(dict(zip(event.branches, event.tokens)), event.finished, event.step + 1)

    def record(self, tokens: dict[str, int], finished: Iterable[str], steps: int) -> None:
        """One step's new token per branch (by name), the branches that stopped early at it, the steps so far."""
        for name, token in tokens.items():
            self.tokens[name].append(token)
        self.finished.update(finished)
        self.steps = steps
        self.seconds = time.perf_counter() - self.started
        if time.perf_counter() - self._last_redraw >= self.min_interval_s:
            self._redraw()

    def finish(self, interrupted: bool) -> None:
        self.state = "interrupted" if interrupted else "done"
        self.seconds = time.perf_counter() - self.started
        self._redraw()
        self._engine = None  # the view may outlive the engine in the output history

    def _redraw(self) -> None:
        self._last_redraw = time.perf_counter()
        self.redraws += 1
        if self.handle is not None:
            self.handle.update(self)

    # ---- rendering --------------------------------------------------------------------------------
    def _summary(self) -> str:
        total = sum(len(t) for t in self.tokens.values())
        rate = f"{total / self.seconds:,.0f} tok/s" if self.seconds > 0 else "- tok/s"
        where = f"{self.steps}/{self.max_steps} steps"
        if self.state == "done":
            return (f"✓ {counted(len(self.names), 'branch')}, {counted(total, 'token')}, "
                    f"{counted(self.steps, 'step')} in {self.seconds:.2f} s ({rate})")
        if self.state == "interrupted":
            return (f"⏹ interrupted at {where}: every branch kept the tokens of the completed steps "
                    f"({counted(total, 'token')} in {self.seconds:.2f} s, {rate})")
        return f"{where}, {counted(total, 'token')}, {rate}"

    def _lines(self) -> list[tuple[str, str]]:
        if self.state != "running":
            return []
        shown = self.names[:MAX_LINES]
        lines = []
        for name in shown:
            text = (self._engine.decode(self.tokens[name], skip_end_tokens=True) if self._engine.tokenizer
                    else str(self.tokens[name]))
            mark = " ✓" if name in self.finished else ""
            lines.append((f"{name}{mark}", one_line(text, LINE_WIDTH)))
        if len(self.names) > MAX_LINES:
            lines.append(("…", f"{len(self.names) - MAX_LINES} more branches"))
        return lines

    def __repr__(self) -> str:
        # min: a value function that re-ranks branches mid-call can take more steps than the estimate
        done = BAR_WIDTH if self.state == "done" else min(BAR_WIDTH, BAR_WIDTH * self.steps // max(1, self.max_steps))
        bar = "[" + "#" * done + "-" * (BAR_WIDTH - done) + "]"
        lines = self._lines()
        width = max((len(label) for label, _ in lines), default=0)
        return "\n".join([f"{bar} {self._summary()}", *(f"{label:>{width}} │ {text}" for label, text in lines)])

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        value = self.max_steps if self.state == "done" else min(self.steps, self.max_steps)
        rows = "".join(f"<div><b>{html.escape(label)}</b> │ {html.escape(text)}</div>" for label, text in self._lines())
        return (f"<div class='dendrite-live'><progress value='{value}' max='{self.max_steps}' "
                f"style='width:18em;vertical-align:middle'></progress> {html.escape(self._summary())}"
                f"<div style='font-family:monospace;white-space:pre'>{rows}</div></div>")
