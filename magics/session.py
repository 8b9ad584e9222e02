"""The per-kernel session: one Engine for the life of the kernel, plus what the views need from it.

A session outlives cells; magics reach it through `current_session()`. Loading a second model
closes the first engine (its weights and KV cache are freed at once, even if a notebook variable
still refers to it), so a kernel never holds two models by accident. A server the session runs
(`%dendrite serve`) is stopped first, and when the kernel exits. Where either engine is
tensor-parallel, the first is closed before the second loads: its workers hold the GPUs.
"""
from __future__ import annotations

import atexit
import fnmatch
import gc
import multiprocessing
import warnings
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Callable

import traitlets
from IPython.core.error import UsageError
from IPython.core.magic import Magics

from dendrite_nb import Branch, Engine, StepHistory
from dendrite_nb.widgets import BlockTableView, ThroughputView, TreeView

from .arguments import user_errors
from .rerun import CellWrite
from .results import listed
from .serving import KernelServer

GLOB_CHARACTERS = "*?["


@dataclass
class Autosave:
    path: Path
    every: int  # generating cells between saves
    cells: int = 0  # generating cells since autosave was turned on
    saves: int = 0
    last_cell: int = -1  # the cell serial that last counted (two %gen lines in one cell count once)


class Session:
    def __init__(self):
        self.engine: Engine | None = None
        self.source: str | None = None           # the checkpoint folder, or "demo: MODEL (PATH)"
        self.demo_options: tuple[str, int, int] | None = None  # (device, num_blocks, tp) of %dendrite demo's engine
        self.history = StepHistory()             # step timings of the latest generation, for %throughput
        self.cell_source: str | None = None      # the raw text of the cell now running (pre_run_cell)
        self.last_result: Any = None             # the last generation's result, kept even when interrupted
        self._subscription = None
        self._views: dict[str, Any] = {}         # one live view of each kind per engine, made on first use
        self._selection_link = None
        self.cell_serial = 0                     # counts cells (pre_run_cell), so autosave counts cells, not magics
        self.autosave: Autosave | None = None
        self.server: KernelServer | None = None  # %dendrite serve's, while it runs
        self._stops_server_at_exit = False
        self.cell_writes: dict[str, CellWrite] = {}  # per branch: what the last %%branch cell wrote to it

    # ---- autosave ------------------------------------------------------------------------------
    def generated(self) -> None:
        """A magic generated tokens: after every N-th generating cell, save the session (if asked)."""
        policy = self.autosave
        if policy is None or self.engine is None or policy.last_cell == self.cell_serial:
            return
        policy.last_cell = self.cell_serial
        policy.cells += 1
        if policy.cells % policy.every == 0:
            try:
                self.engine.save(policy.path)
                policy.saves += 1
            except Exception as error:  # a failed autosave must not fail the cell that generated
                warnings.warn(f"autosave to {policy.path} failed: {error}", RuntimeWarning, stacklevel=2)

    # ---- the engine -----------------------------------------------------------------------------
    def require_engine(self) -> Engine:
        if self.engine is None:
            raise UsageError("no model is loaded in this kernel; run `%dendrite demo` (the default model) "
                             "or `%dendrite load PATH` first.")
        return self.engine

    def install(self, engine: Engine, source: str, replace: bool,
                demo_options: tuple[str, int, int] | None = None) -> Engine | None:
        """Make `engine` the session's engine. Returns the engine it replaced (already closed), if any.
        demo_options: the (device, num_blocks, tp) %dendrite demo loaded it with, so a second %dendrite demo
        asking for the same can reuse it."""
        try:
            self.check_can_load(replace)
        except UsageError:
            engine.close()
            raise
        old = self.close_engine()
        self.engine, self.source, self.demo_options = engine, source, demo_options
        self.history = StepHistory()
        self._subscription = engine.subscribe(self.history)
        return old

    def load(self, make: Callable[..., Engine], source: str, replace: bool, tensor_parallel: int,
             demo_options: tuple[str, int, int] | None = None, *, make_closes: bool = False
             ) -> tuple[Engine, Engine | None]:
        """Make the session's engine with make(), whose request the caller has checked already (a bad path,
        option or degree must change nothing); returns (the new engine, the one it replaced, closed, or None).
        The loaded engine keeps working while the new one loads, so a load that fails leaves it as it was,
        except where either is tensor-parallel: the loaded one is closed first, since its workers hold devices
        the new one needs (two GPUs full of one model cannot take a second). A load that fails after that leaves
        the session without an engine, and its error says so. make_closes: make takes the function that closes
        the loaded engine (None where none needs closing) and calls it once its own checks have passed (restore's
        before_build), so it checks what it reads only once."""
        self.check_can_load(replace)
        old = self.engine
        if old is None or (tensor_parallel == 1 and old.tensor_parallel == 1):
            with user_errors():
                engine = make(None) if make_closes else make()
            return engine, self.install(engine, source, replace, demo_options)
        closed = repr(old)
        was_closed = []

        def close_first() -> None:
            self.close_engine()
            was_closed.append(True)

        if not make_closes:
            close_first()
        try:
            with user_errors():
                engine = make(close_first) if make_closes else make()
        except UsageError as error:
            if not was_closed:   # refused by make's checks: the loaded engine is untouched
                raise
            raise UsageError(f"{error} (The engine loaded before, {closed}, was closed first to free its devices, "
                             f"as --replace does where a tensor-parallel engine is involved: no model is loaded "
                             f"now.)") from None
        self.install(engine, source, replace, demo_options)
        return engine, old

    def close_engine(self) -> Engine | None:
        """Close the session's engine (a tensor-parallel one's workers end with it), its views and its server, and
        leave the session without one. Returns it, closed, or None."""
        self.stop_server()
        self.cell_writes.clear()
        old = self.engine
        if old is not None:
            self.close_views()
            self._subscription.close()
            if not old.closed:   # the notebook may have closed it (current_engine().close())
                old.close()
            gc.collect()
        self.engine = self.source = self.demo_options = None
        return old

    def kernel_exiting(self) -> None:
        """The kernel shuts down (ipykernel sets the shell's exit_now, then ends the kernel's child processes before
        Python's exit handlers run): close the engine now, so a tensor-parallel one's workers end as close() ends
        them, and stop multiprocessing's resource tracker (stop_resource_tracker)."""
        self.close_engine()
        stop_resource_tracker()

    def check_can_load(self, replace: bool) -> None:
        """Refuse before spending time on loading a checkpoint that would be refused anyway."""
        if self.engine is not None and not replace:
            raise UsageError(f"a model is already loaded ({self.source}); add --replace to close it and load "
                             f"another (its branches will be gone), or keep working with it.")

    # ---- the server ---------------------------------------------------------------------------------
    def start_server(self, host: str, port: int, api_key: str | None, replace: bool) -> KernelServer:
        """Serve the session's engine (KernelServer); with replace, the running server is stopped first."""
        engine = self.require_engine()
        running = self.running_server()
        if running is not None and not replace:
            raise UsageError(f"a server is running already, at {running.url}; stop it first (%dendrite serve stop) "
                             f"or add --replace to stop it and start this one.")
        self.stop_server()
        self.server = KernelServer(engine, host, port, api_key)
        if not self._stops_server_at_exit:   # a kernel that shuts down closes the port and the streams in flight
            atexit.register(self.stop_server)
            self._stops_server_at_exit = True
        return self.server

    def running_server(self) -> KernelServer | None:
        """The session's server, if it runs."""
        server = self.server
        return server if server is not None and server.running else None

    def stop_server(self) -> KernelServer | None:
        """Stop the session's server, if any; returns it (stopped)."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        return server

    # ---- live views -------------------------------------------------------------------------------
    # One of each per engine: `%tree` run twice shows two views of one model, not two listeners.
    def tree_view(self) -> TreeView:
        return self._view("tree", lambda engine: TreeView(engine))

    def block_table_view(self) -> BlockTableView:
        return self._view("blocks", lambda engine: BlockTableView(engine))

    def throughput_view(self) -> ThroughputView:
        return self._view("throughput", lambda engine: ThroughputView(engine, self.history))

    def _view(self, kind: str, make) -> Any:
        engine = self.require_engine()
        if kind not in self._views:
            self._views[kind] = make(engine)
            self._link_selection()
        return self._views[kind]

    def _link_selection(self) -> None:
        """Clicking a node in %tree outlines that branch's blocks in %blocks."""
        if self._selection_link is None and {"tree", "blocks"} <= self._views.keys():
            self._selection_link = traitlets.link((self._views["tree"], "selected"),
                                                  (self._views["blocks"], "selected"))

    def close_views(self) -> None:
        if self._selection_link is not None:
            self._selection_link.unlink()
            self._selection_link = None
        for view in self._views.values():
            view.close()
        self._views.clear()

    # ---- branch selection -----------------------------------------------------------------------
    def select(self, patterns: list[str]) -> list[Branch]:
        """Branches named by names or glob patterns (`plan/*`), in order, each once.
        Every pattern must match something: a typo should not silently shrink a batch."""
        engine = self.require_engine()
        names = sorted(engine.branches)
        chosen: list[str] = []
        for pattern in patterns:
            if any(c in pattern for c in GLOB_CHARACTERS):
                matched = fnmatch.filter(names, pattern)
                if not matched:
                    raise UsageError(f"no branch matches {pattern!r}; the branches are: {describe_names(names)}.")
            elif pattern in engine.branches:
                matched = [pattern]
            else:
                raise UsageError(f"there is no branch {pattern!r}; the branches are: {describe_names(names)}.")
            chosen.extend(m for m in matched if m not in chosen)
        return [engine.branch(name) for name in chosen]


class SessionBoundMagics(Magics):
    """The base of each theme's Magics class (session_magics.py, branch_magics.py, ...): all of them work on the
    kernel's one session."""

    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, the process the first spawned worker started in this kernel, once
    no process it serves is left. At shutdown ipykernel sends the kernel's children SIGTERM, then SIGKILL, retrying
    for about 30 s while any is left: the tracker ignores SIGTERM and, killed, stays a zombie until the kernel
    exits, so the shutdown took 30 s, and the semaphores it tracks (those of a worker that was killed) stayed in
    /dev/shm. Stopped, it unlinks them and exits at once. The call is private to multiprocessing (its tests use it)."""
    if not multiprocessing.active_children():   # a live child would keep the tracker, and this wait, going
        resource_tracker._resource_tracker._stop()


def check_new_name(name: str) -> None:
    if any(c in name for c in GLOB_CHARACTERS + "]") or not name.strip() or name != name.strip():
        raise UsageError(f"{name!r} cannot name a branch: names may not contain *, ?, [ or ] (they are glob "
                         f"patterns in %gen and %prune) or start or end with spaces.")


def describe_names(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none yet (create one with %%branch NAME)"
    return listed(names, limit)


def source_label(path: str | Path) -> str:
    return str(Path(path).expanduser())
