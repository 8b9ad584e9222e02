"""The notebook layer (installed as dendrite_nb.magics): IPython magics and the per-kernel session.

    %load_ext dendrite_nb
    %dendrite demo
    %%branch root / %fork root --n 3 / %gen root/* -n 32 / %prune root/1 / %show root/0 / %tree

From Python: `current_engine()` is the session's Engine, `current_session()` the session itself.
It may import dendrite_nb and dendrite_nb.widgets; the engine never imports it. It calls only the engine's
public API.

    session_magics.py  %dendrite: load, demo, restore, save, autosave, serve, status
    branch_magics.py   %%branch, %fork, %prune, %show
    rerun.py           a %%branch cell run again: the same text is a no-op, edited text prefills only its tail
    gen_magic.py       %gen, and the streaming generation %%branch --gen shares
    server_gen.py      %gen while the kernel's server runs: decoded in the server's batch
    serving.py         the kernel's OpenAI-compatible server (%dendrite serve)
    view_magics.py     %tree, %blocks, %throughput
    arguments.py       argument parsing, the sampling options, engine refusals as UsageErrors
    cell_options.py    a cell's constraint, from its metadata or its `#|` lines
    session.py         the per-kernel Session (engine lifetime, autosave, views, branch globs)
    live.py            the streaming view of a generation
    results.py, show.py, views.py   what the magics return
    nbval_plugin.py    cell metadata under `pytest --nbval`
"""
from __future__ import annotations

import contextlib

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
    from .branch_magics import BranchMagics
    from .gen_magic import GenMagics
    from .session_magics import SessionMagics
    from .view_magics import ViewMagics

    for magics in (SessionMagics, BranchMagics, GenMagics, ViewMagics):   # one class per theme, one session
        ipython.register_magics(magics(ipython, _SESSION))
    if _remember_cell not in ipython.events.callbacks["pre_run_cell"]:
        ipython.events.register("pre_run_cell", _remember_cell)
    ipython.observe(_exiting, names="exit_now")


def unload_ipython_extension(ipython) -> None:
    if _remember_cell in ipython.events.callbacks["pre_run_cell"]:
        ipython.events.unregister("pre_run_cell", _remember_cell)
    with contextlib.suppress(ValueError):   # traitlets' word for a handler it does not hold
        ipython.unobserve(_exiting, names="exit_now")


def _exiting(change) -> None:
    """The shell's exit_now turned on: the kernel is shutting down (Session.kernel_exiting)."""
    if change["new"]:
        _SESSION.kernel_exiting()
