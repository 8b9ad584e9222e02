"""Make nbval run a notebook the way JupyterLab / Notebook 7 runs it.

Why this exists: nbval sends every cell as a bare ``execute_request`` with an empty ``metadata``
field. JupyterLab sends the cell's metadata there (``{...cell.metadata, "deletedCells": [],
"recordTiming": false, "cellId": "<id>"}``), and inside the kernel it is
``get_ipython().kernel.get_parent()["metadata"]``. A dendrite notebook whose cells read
constraints from cell metadata (e.g. ``{"dendrite": {"regex": ...}}``) would therefore run one
way in the browser and another under ``pytest --nbval``. This plugin sends the same metadata.

It also applies ``update_display_data`` the way a front end does. nbval records only the first
``display_data`` of a display (and prints "unhandled iopub msg: update_display_data"), whereas
a front end -- and the notebook it saves -- shows the display's *final* content. Here each
``display_data`` carrying ``transient.display_id`` is remembered for the current cell, and a later
``update_display_data`` for that id replaces its ``data`` and ``metadata`` in place before nbval
compares outputs; the update message itself is not handed to nbval.

Enable it next to ``--nbval``::

    pytest --nbval -p dendrite_nb.magics.nbval_plugin notebooks/

or in pyproject.toml::

    [tool.pytest.ini_options]
    addopts = "-p dendrite_nb.magics.nbval_plugin"

Without ``--nbval`` / ``--nbval-lax`` (or without nbval installed) it does nothing. It works by
wrapping three nbval methods for the duration of the pytest run: ``IPyNbCell.runtest`` (to know
the cell being run), ``RunningKernel.execute_cell_input`` (to send the metadata) and
``IPyNbFile.get_kernel_message`` (to apply display updates).
"""
from __future__ import annotations

import functools
import json
import logging

logger = logging.getLogger("nbval")

_CELL_ATTR = "_dendrite_current_cell"  # on the RunningKernel: the cell being executed
_DISPLAYS_ATTR = "_dendrite_displays"  # on the IPyNbFile: display_id -> [data/metadata holder]
_originals: list[tuple[type, str, object]] = []


def execute_request_metadata(cell) -> dict:
    """The execute_request ``metadata`` JupyterLab sends for `cell` (CodeCell.execute:
    ``Object.assign({}, model.metadata, {deletedCells, recordTiming}, {cellId})``)."""
    metadata = json.loads(json.dumps(dict(cell.get("metadata", {}))))  # plain JSON, no NotebookNodes
    metadata.update(deletedCells=[], recordTiming=False)
    if cell.get("id"):
        metadata["cellId"] = cell["id"]
    return metadata


def _wrap_runtest(runtest):
    @functools.wraps(runtest)
    def wrapper(self):
        setattr(self.parent, _DISPLAYS_ATTR, {})  # display ids are tracked per cell
        kernel = self.parent.kernel
        if kernel is not None:
            setattr(kernel, _CELL_ATTR, self.cell)
        try:
            return runtest(self)
        finally:
            if kernel is not None:
                setattr(kernel, _CELL_ATTR, None)

    return wrapper


def _wrap_execute_cell_input(execute_cell_input):
    @functools.wraps(execute_cell_input)
    def wrapper(self, cell_input, allow_stdin=None):
        cell = getattr(self, _CELL_ATTR, None)
        if cell is None:  # not called for a cell by runtest: leave nbval's request alone
            return execute_cell_input(self, cell_input, allow_stdin=allow_stdin)
        kc = self.kc
        if not isinstance(cell_input, str):
            raise ValueError("code %r must be a string" % cell_input)
        logger.debug("Executing cell (with metadata): %r...", cell_input.splitlines()[:1])
        # The same content nbval sends through kc.execute(cell_input, store_history=False,
        # allow_stdin=allow_stdin, stop_on_error=False); KernelClient.execute takes no metadata.
        content = {
            "code": cell_input,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": kc.allow_stdin if allow_stdin is None else allow_stdin,
            "stop_on_error": False,
        }
        msg = kc.session.msg("execute_request", content, metadata=execute_request_metadata(cell))
        kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    return wrapper


def _wrap_get_kernel_message(get_kernel_message):
    from nbformat import from_dict

    @functools.wraps(get_kernel_message)
    def wrapper(self, timeout=None, stream="iopub"):
        while True:
            msg = get_kernel_message(self, timeout=timeout, stream=stream)
            if stream != "iopub":
                return msg
            displays = self.__dict__.setdefault(_DISPLAYS_ATTR, {})
            msg_type = msg.get("msg_type")
            content = msg.get("content", {})
            display_id = (content.get("transient") or {}).get("display_id")
            if msg_type == "display_data" and display_id is not None:
                # nbval stores `out['data'] = reply['data']`, and NotebookNode.__setitem__ copies a
                # plain dict but keeps a NotebookNode as is: hand nbval NotebookNodes, so the output
                # it records is the very object a later update rewrites.
                content["data"] = from_dict(content.get("data", {}))
                content["metadata"] = from_dict(content.get("metadata", {}))
                displays.setdefault(display_id, []).append(content)
                return msg
            if msg_type == "update_display_data":
                for shown in displays.get(display_id, ()):
                    for key in ("data", "metadata"):
                        node = shown[key]  # the NotebookNode nbval holds
                        node.clear()
                        node.update(content.get(key, {}))
                # swallowed, like a front end (an update of a display from an earlier cell changes
                # nothing this cell compares); nbval's per-message timeout applies to the next one
                continue
            return msg

    return wrapper


def _patch(cls, name, wrap):
    original = cls.__dict__[name]
    _originals.append((cls, name, original))
    setattr(cls, name, wrap(original))


def pytest_configure(config):
    if not (getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False)):
        return
    if _originals:  # already patched (plugin configured twice in one process)
        return
    from nbval.kernel import RunningKernel
    from nbval.plugin import IPyNbCell, IPyNbFile

    _patch(IPyNbCell, "runtest", _wrap_runtest)
    _patch(RunningKernel, "execute_cell_input", _wrap_execute_cell_input)
    _patch(IPyNbFile, "get_kernel_message", _wrap_get_kernel_message)


def pytest_unconfigure(config):
    while _originals:
        cls, name, original = _originals.pop()
        setattr(cls, name, original)
