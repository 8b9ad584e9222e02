"""Plain views for %tree, %blocks, %throughput and %dendrite status, drawn from engine snapshots.

They are static HTML (and text for the terminal); the live anywidget views replace them once
dendrite_nb.widgets provides them.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from .results import PrettyByRepr, table_html
from .session import Session, StepRecord

MAX_BLOCK_CELLS = 4096   # HTML cells drawn for %blocks; larger pools are summarised
REFCOUNT_COLOURS = ["#c7e9c0", "#74c476", "#fd8d3c", "#e6550d", "#a63603"]  # 1, 2, 3, 4, 5+ readers


@dataclass(frozen=True, repr=False)
class TreeView(PrettyByRepr):
    snapshot: dict[str, Any]

    def _label(self, node: dict[str, Any]) -> str:
        names = f" [{', '.join(node['branches'])}]" if node["branches"] else ""
        if node["parent"] is None:
            return f"root{names}"
        return f"node {node['id']}: +{node['num_tokens']:,} tokens at {node['start']:,}, {len(node['blocks'])} blocks{names}"

    def lines(self) -> list[str]:
        nodes = {node["id"]: node for node in self.snapshot["nodes"]}
        root = next(node for node in nodes.values() if node["parent"] is None)
        out = [self._label(root)]

        def walk(node_id: int, prefix: str) -> None:
            children = nodes[node_id]["children"]
            for index, child in enumerate(children):
                last = index == len(children) - 1
                out.append(prefix + ("└── " if last else "├── ") + self._label(nodes[child]))
                walk(child, prefix + ("    " if last else "│   "))

        walk(root["id"], "")
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        return f"<pre class='dendrite-tree'>{html.escape(repr(self))}</pre>"


@dataclass(frozen=True, repr=False)
class BlocksView(PrettyByRepr):
    snapshot: dict[str, Any]

    def _summary(self) -> str:
        used = self.snapshot["blocks"]
        shared = sum(1 for b in used if b["readers"] > 1)
        return (f"{len(used):,} of {self.snapshot['num_blocks']:,} KV blocks in use "
                f"({self.snapshot['block_size']} tokens each), {shared:,} read by more than one branch, "
                f"{self.snapshot['num_free']:,} free")

    def __repr__(self) -> str:
        lines = [self._summary()]
        for name, table in self.snapshot["branches"].items():
            lines.append(f"  {name}: {table}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        by_id = {b["id"]: b for b in self.snapshot["blocks"]}
        drawn = min(self.snapshot["num_blocks"], MAX_BLOCK_CELLS)
        cells = []
        for block_id in range(drawn):
            block = by_id.get(block_id)
            if block is None:
                title, colour = f"block {block_id}: free", "rgba(127,127,127,0.15)"
            else:
                colour = REFCOUNT_COLOURS[min(block["readers"], len(REFCOUNT_COLOURS)) - 1] if block["readers"] else "#999"
                title = (f"block {block_id}: node {block['node']}, logical {block['logical_index']}, "
                         f"{block['filled']} tokens, refcount {block['refcount']}, {block['readers']} readers")
            cells.append(f"<span class='dendrite-block' title='{html.escape(title, quote=True)}' "
                         f"style='width:10px;height:10px;display:inline-block;background:{colour}'></span>")
        more = (f"<div>showing the first {drawn:,} of {self.snapshot['num_blocks']:,} blocks</div>"
                if drawn < self.snapshot["num_blocks"] else "")
        grid = ("<div style='display:grid;grid-template-columns:repeat(auto-fill,10px);gap:1px;max-width:64em'>"
                + "".join(cells) + "</div>")
        legend = " ".join(f"<span style='background:{c};padding:0 4px'>{i + 1}{'+' if i == 4 else ''}</span>"
                          for i, c in enumerate(REFCOUNT_COLOURS))
        return f"<div class='dendrite-blocks'><div>{html.escape(self._summary())}; readers: {legend}</div>{grid}{more}</div>"


@dataclass(frozen=True, repr=False)
class ThroughputView(PrettyByRepr):
    steps: tuple[StepRecord, ...]   # the last generate call's steps

    def _summary(self) -> str:
        if not self.steps:
            return "no decode steps yet; run %gen first"
        seconds = sum(s.step_s for s in self.steps)
        tokens = sum(s.batch_size for s in self.steps)
        return (f"last generation: {len(self.steps)} steps, {tokens:,} tokens in {seconds:.2f} s "
                f"({tokens / seconds:,.0f} tok/s; mean step {1e3 * seconds / len(self.steps):.1f} ms)")

    def __repr__(self) -> str:
        return self._summary()

    def _repr_html_(self) -> str:
        if not self.steps:
            return f"<div>{html.escape(self._summary())}</div>"
        rates = [s.tokens_per_s for s in self.steps]
        top = max(rates) or 1.0
        width, height = 400, 80
        dx = width / max(1, len(rates) - 1)
        points = " ".join(f"{i * dx:.1f},{height - height * r / top:.1f}" for i, r in enumerate(rates))
        svg = (f"<svg width='{width}' height='{height}' style='border:1px solid rgba(127,127,127,0.4)'>"
               f"<polyline points='{points}' fill='none' stroke='#1f77b4' stroke-width='1.5'/></svg>")
        rows = [[str(s.step), str(s.batch_size), f"{1e3 * s.step_s:.1f}", f"{s.tokens_per_s:,.0f}"] for s in self.steps[-10:]]
        return (f"<div class='dendrite-throughput'><div>{html.escape(self._summary())}</div>{svg}"
                f"{table_html(['step', 'batch', 'step ms', 'tok/s'], rows, 'last 10 steps')}</div>")


def last_call_steps(session: Session) -> tuple[StepRecord, ...]:
    last = session.generate_calls - 1
    return tuple(s for s in session.steps if s.call == last)


@dataclass(frozen=True, repr=False)
class StatusView(PrettyByRepr):
    engine: str
    source: str
    branches: tuple[tuple[str, int], ...]
    used_blocks: int
    num_blocks: int
    kv_mib: float

    def __repr__(self) -> str:
        names = ", ".join(f"{n} ({t:,})" for n, t in self.branches[:20]) or "none"
        more = f" and {len(self.branches) - 20} more" if len(self.branches) > 20 else ""
        return (f"{self.engine}\nfrom {self.source}\nKV pool: {self.used_blocks:,}/{self.num_blocks:,} blocks used "
                f"({self.kv_mib:,.1f} MiB)\nbranches (tokens): {names}{more}")
