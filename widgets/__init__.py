"""Live anywidget views of an engine (installed as dendrite_nb.widgets).

    from dendrite_nb.widgets import TreeView, BlockTableView, ThroughputView
    TreeView(engine)          # the branch tree; click a node, read view.selected
    BlockTableView(engine)    # every KV block of the pool, coloured by how many branches read it
    ThroughputView(engine)    # tokens/s, step time and batch size per decode step

Each view listens to the engine (Engine.subscribe) and updates while a cell is still running, at
most about ten times a second. They read dendrite_nb's plain-data snapshots and never import
dendrite_nb.magics. `view.close()` stops the updates.
"""
from .block_table_view import BlockTableView
from .throughput_view import ThroughputView
from .tree_view import TreeView, node_label, tree_lines

__all__ = ["BlockTableView", "ThroughputView", "TreeView", "node_label", "tree_lines"]
