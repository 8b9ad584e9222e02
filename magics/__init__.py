"""The notebook layer (installed as dendrite_nb.magics): IPython magics and the per-kernel session.

It may import dendrite_nb and dendrite_nb.widgets; the engine never imports it.
"""
