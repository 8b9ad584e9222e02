"""BlockTableView: every physical block of the KV pool on a canvas, coloured by how many branches read it."""
from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from dendrite_nb.wording import counted

from .engine_view import EngineView, view_module

MAX_READERS_SENT = 65_535   # readers travel as uint16; more than that is shown as the maximum


class BlockTableView(EngineView):
    """One cell per block: free, or coloured by its readers (1, 2, 3, 4, 5+ branches). The selected
    branch's blocks are outlined; a copy-on-write copy (a branch's private copy of a shared partial
    block) carries a corner mark. Hover a cell for its block id, node, position and refcount.
    A canvas, not one element per block, so a 100,000-block pool draws in milliseconds."""

    _esm = view_module("blocks.js")
    selected = traitlets.Unicode(None, allow_none=True).tag(sync=True)  # a branch name, or None
    _num_blocks = traitlets.Int(0).tag(sync=True)
    _block_size = traitlets.Int(0).tag(sync=True)
    _readers = traitlets.Bytes(b"").tag(sync=True)         # uint16 [num_blocks]: 0 = free
    _refcounts = traitlets.Bytes(b"").tag(sync=True)       # uint16 [num_blocks]
    _nodes = traitlets.Bytes(b"").tag(sync=True)           # int32 [num_blocks]: owning node, -1 = free
    _logical = traitlets.Bytes(b"").tag(sync=True)         # int32 [num_blocks]: logical index in its node's path
    _filled = traitlets.Bytes(b"").tag(sync=True)          # uint16 [num_blocks]: token slots in use
    _copy_on_write = traitlets.Bytes(b"").tag(sync=True)   # uint8 [num_blocks]: 1 = a copy-on-write copy
    _selected_blocks = traitlets.Bytes(b"").tag(sync=True)  # int32: the selected branch's block table
    _summary = traitlets.Unicode("").tag(sync=True)

    @traitlets.validate("selected")
    def _check_selected(self, proposal):
        return self._live_branch(proposal["value"], "outline")

    @traitlets.observe("selected")
    def _outline_selected(self, change) -> None:
        if not self._holding_sync:   # a change made inside _sync is sent with the rest of that update
            self._push()

    def _state(self) -> dict[str, Any]:
        snapshot = self._engine.block_table()
        num_blocks = snapshot["num_blocks"]
        used = snapshot["blocks"]

        def column(key: str, dtype, free_value: int = 0) -> np.ndarray:
            """One value per physical block: `key` of the blocks in use, `free_value` for the free ones."""
            values = np.full(num_blocks, free_value, dtype=dtype)
            values[ids] = np.fromiter((block[key] for block in used), dtype=np.int64, count=len(used))
            return values

        ids = np.fromiter((block["id"] for block in used), dtype=np.int64, count=len(used))
        readers = np.minimum(column("readers", np.int64), MAX_READERS_SENT).astype(np.uint16)
        refcounts = column("refcount", np.uint16)
        nodes, logical = column("node", np.int32, -1), column("logical_index", np.int32, -1)
        filled, copies = column("filled", np.uint16), column("copy_on_write", np.uint8)
        selected = getattr(self, "selected", None)
        selected = selected if selected in snapshot["branches"] else None   # None once pruned
        shared = int((readers > 1).sum())
        return {
            "_num_blocks": num_blocks, "_block_size": snapshot["block_size"],
            "_readers": readers.tobytes(), "_refcounts": refcounts.tobytes(), "_nodes": nodes.tobytes(),
            "_logical": logical.tobytes(), "_filled": filled.tobytes(), "_copy_on_write": copies.tobytes(),
            "selected": selected,
            "_selected_blocks": np.asarray(snapshot["branches"].get(selected, []), dtype=np.int32).tobytes(),
            "_summary": (f"{len(snapshot['blocks']):,} of {counted(num_blocks, 'KV block')} in use "
                         f"({counted(snapshot['block_size'], 'token')} each), {shared:,} read by more than one branch, "
                         f"{counted(int(copies.sum()), 'copy-on-write copy')}, {snapshot['num_free']:,} free"),
        }

    def __repr__(self) -> str:
        if self._engine.closed:
            return "BlockTableView(engine closed)"
        snapshot = self._engine.block_table()
        lines = [self._state()["_summary"]]
        lines += [f"  {name}: {table}" for name, table in snapshot["branches"].items()]
        return "\n".join(lines)
