"""anywidget views of engine snapshots (installed as dendrite_nb.widgets).

They read dendrite_nb's plain-data snapshots and never import dendrite_nb.magics.
"""
