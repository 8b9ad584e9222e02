"""The notebook layer (installed as dendrite_nb.magics): IPython magics and the per-kernel session.

    %load_ext dendrite_nb
    %dendrite demo
    %%branch root / %fork root --n 3 / %gen root/* -n 32 / %prune root/1 / %show root/0 / %tree

From Python: `current_engine()` is the session's Engine, `current_session()` the session itself.
It may import dendrite_nb and dendrite_nb.widgets; the engine never imports it.
"""
from __future__ import annotations

from dendrite_nb import Engine

from .session import Session

_SESSION = Session()  # one per kernel process: a kernel runs one IPython shell


def current_session() -> Session:
    return _SESSION


def current_engine() -> Engine:
    """The engine that `%dendrite load` or `%dendrite demo` put in this kernel's session."""
    return _SESSION.require_engine()


def _remember_cell(info) -> None:
    _SESSION.cell_source = info.raw_cell
    _SESSION.cell_serial += 1


def load_ipython_extension(ipython) -> None:
    from .magics import DendriteMagics

    ipython.register_magics(DendriteMagics(ipython, _SESSION))
    if _remember_cell not in ipython.events.callbacks["pre_run_cell"]:
        ipython.events.register("pre_run_cell", _remember_cell)


def unload_ipython_extension(ipython) -> None:
    if _remember_cell in ipython.events.callbacks["pre_run_cell"]:
        ipython.events.unregister("pre_run_cell", _remember_cell)
