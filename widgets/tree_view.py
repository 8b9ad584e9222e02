"""TreeView: the branch tree as a collapsible SVG, live; clicking a node selects its branch (`view.selected`)."""
from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from dendrite_nb.events import Event
from dendrite_nb.wording import counted

from .branch_states import BranchStates
from .engine_view import EngineView, view_module

TAIL_TOKENS = 24          # tokens of a node's text shown in its tooltip
MAX_LABEL_NAMES = 3       # branch names spelled out in a node's label; the rest are counted


def node_label(node: dict[str, Any]) -> str:
    """What the view writes next to a node of `engine.tree()`: its branch names (root: 'root')."""
    names = node["branches"]
    if node["parent"] is None:
        return "root" + (f" · {', '.join(names)}" if names else "")
    shown = ", ".join(names[:MAX_LABEL_NAMES])
    return shown + (f" +{len(names) - MAX_LABEL_NAMES}" if len(names) > MAX_LABEL_NAMES else "")


def tree_lines(snapshot: dict[str, Any]) -> list[str]:
    """The tree as text, one line per node, for terminals and reprs."""
    nodes = {node["id"]: node for node in snapshot["nodes"]}

    def line(node: dict[str, Any]) -> str:
        names = f" [{', '.join(node['branches'])}]" if node["branches"] else ""
        if node["parent"] is None:
            return f"root{names}"
        score = f", mean logprob {node['mean_logprob']:.3f}" if node["mean_logprob"] is not None else ""
        return (f"node {node['id']}: +{counted(node['num_tokens'], 'token')} at {node['start']:,}, "
                f"{counted(len(node['blocks']), 'block')}{score}{names}")

    root = next(node for node in nodes.values() if node["parent"] is None)
    out = [line(root)]

    def walk(node_id: int, prefix: str) -> None:
        children = nodes[node_id]["children"]
        for index, child in enumerate(children):
            last = index == len(children) - 1
            out.append(prefix + ("└── " if last else "├── ") + line(nodes[child]))
            walk(child, prefix + ("    " if last else "│   "))

    walk(root["id"], "")
    return out


class TreeView(EngineView):
    """Nodes sized by token count, labelled by branch, coloured by state (idle, decoding, finished, preempted).
    Hover for a node's text tail, tokens, blocks and refcounts; click a node to select its branch
    (again to cycle when several branches share it); the ▾ toggle collapses a subtree."""

    _esm = view_module("tree.js")
    selected = traitlets.Unicode(None, allow_none=True).tag(sync=True)
    _nodes = traitlets.List().tag(sync=True)              # per node: id, parent, label, tokens, state, ...
    _block_offsets = traitlets.Bytes(b"").tag(sync=True)  # int32 [num_nodes + 1]: CSR offsets into _blocks
    _blocks = traitlets.Bytes(b"").tag(sync=True)         # int32: each node's physical block ids
    _refcounts = traitlets.Bytes(b"").tag(sync=True)      # uint16, aligned with _blocks
    _summary = traitlets.Unicode("").tag(sync=True)

    def __init__(self, engine, **kwargs):
        self._states = BranchStates()
        super().__init__(engine, **kwargs)

    def _note(self, event: Event) -> None:
        self._states(event)

    @traitlets.validate("selected")
    def _check_selected(self, proposal):
        return self._live_branch(proposal["value"], "select")

    def _state(self) -> dict[str, Any]:
        engine = self._engine
        snapshot = engine.tree()
        # Two snapshots: a call on another thread between them may free a block; it reads as free (refcount 0),
        # as it would have in the pool, and the next update shows the tree without it.
        refcounts = {block["id"]: block["refcount"] for block in engine.block_table()["blocks"]}
        nodes, offsets, blocks = [], [0], []
        for node in snapshot["nodes"]:
            states = {self._states.state(name) for name in node["branches"]}
            state = ("preempted" if node["preempted"] else
                     next((s for s in ("decoding", "finished", "idle") if s in states), "shared"))
            nodes.append({
                "id": node["id"], "parent": node["parent"], "label": node_label(node),
                "branches": node["branches"], "start": node["start"], "num_tokens": node["num_tokens"],
                "state": state,
                "tail": engine.decode(node["tokens"][-TAIL_TOKENS:], skip_end_tokens=True) if engine.tokenizer else "",
                "mean_logprob": node["mean_logprob"],
                "constraints": [f"{name}: {info['constraint']}{' (complete)' if info['constraint_complete'] else ''}"
                                for name in node["branches"]
                                if (info := snapshot["branches"][name])["constraint"] is not None],
            })
            blocks += node["blocks"]
            offsets.append(len(blocks))
        selected = getattr(self, "selected", None)
        return {
            "_nodes": nodes,
            "_block_offsets": np.asarray(offsets, dtype=np.int32).tobytes(),
            "_blocks": np.asarray(blocks, dtype=np.int32).tobytes(),
            "_refcounts": np.asarray([refcounts.get(b, 0) for b in blocks], dtype=np.uint16).tobytes(),
            "selected": selected if selected in snapshot["branches"] else None,   # None once pruned
            "_summary": f"{counted(len(nodes), 'node')}, {counted(len(snapshot['branches']), 'branch')}, "
                        f"{counted(len(blocks), 'KV block')}",
        }

    def __repr__(self) -> str:
        if self._engine.closed:
            return "TreeView(engine closed)"
        return "\n".join(tree_lines(self._engine.tree()))
