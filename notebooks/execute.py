"""Run the example notebooks top to bottom and save their outputs, the way `pytest --nbval` will check them.

    python notebooks/execute.py                   # every notebook in this folder
    python notebooks/execute.py notebooks/mcts.ipynb

Why not `jupyter nbconvert --execute` / nbclient: they send each cell as a bare execute_request
with empty metadata. JupyterLab sends the cell's metadata there, and the dendrite magics read
constraints from it (`{"dendrite": {"json_schema": ...}}`), so a notebook executed by nbclient would
store different outputs than JupyterLab shows and than the test sees (the test runs nbval with
`-p dendrite_nb.magics.nbval_plugin`, which forwards the metadata too). This script sends the same
request as that plugin (metadata from `execute_request_metadata(cell)`, store_history=False like
nbval) and records outputs like a front end: streams merged per name, `update_display_data`
applied to the earlier display with the same display_id, `transient` dropped.
"""
from __future__ import annotations

import sys
from pathlib import Path
from queue import Empty

import nbformat
from jupyter_client.manager import KernelManager

from dendrite_nb.magics.nbval_plugin import execute_request_metadata

TIMEOUT_S = 600  # a cell may run minutes without printing (the self-consistency samples)


def run_cell(kc, cell, displays: dict) -> tuple[list, bool]:
    """Execute one code cell; returns its outputs and whether it raised."""
    content = {"code": cell.source, "silent": False, "store_history": False, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": False}
    request = kc.session.msg("execute_request", content, metadata=execute_request_metadata(cell))
    kc.shell_channel.send(request)
    msg_id = request["header"]["msg_id"]
    outputs, streams, raised = [], {}, False
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT_S)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, body = msg["msg_type"], msg["content"]
        if kind == "status" and body["execution_state"] == "idle":
            break
        if kind == "stream":
            if body["name"] in streams:
                streams[body["name"]]["text"] += body["text"]
            else:
                streams[body["name"]] = nbformat.v4.new_output("stream", name=body["name"], text=body["text"])
                outputs.append(streams[body["name"]])
        elif kind in ("display_data", "execute_result"):
            out = nbformat.v4.new_output(kind, data=body["data"], metadata=body.get("metadata", {}))
            if kind == "execute_result":
                out["execution_count"] = None  # set with the cell's count below
            display_id = (body.get("transient") or {}).get("display_id")
            if kind == "display_data" and display_id is not None:
                displays.setdefault(display_id, []).append(out)
            outputs.append(out)
        elif kind == "update_display_data":
            for out in displays.get((body.get("transient") or {}).get("display_id"), ()):
                out["data"] = nbformat.from_dict(body["data"])
                out["metadata"] = nbformat.from_dict(body.get("metadata", {}))
        elif kind == "clear_output":
            outputs.clear()
            streams.clear()
        elif kind == "error":
            raised = True
            outputs.append(nbformat.v4.new_output("error", ename=body["ename"], evalue=body["evalue"],
                                                  traceback=body["traceback"]))
    while True:  # the shell reply: a UsageError is only printed to stderr, but the reply says "error"
        try:
            reply = kc.get_shell_msg(timeout=TIMEOUT_S)
        except Empty:
            raise RuntimeError(f"no execute_reply for cell {cell.get('id')}") from None
        if reply["parent_header"].get("msg_id") == msg_id:
            return outputs, raised or reply["content"]["status"] == "error"


def execute_notebook(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"))
    km.start_kernel(cwd=str(path.parent.resolve()))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        displays: dict = {}
        count = 0
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            count += 1
            outputs, raised = run_cell(kc, cell, displays)
            cell.execution_count = count
            for out in outputs:
                if out.output_type == "execute_result":
                    out.execution_count = count
            cell.outputs = outputs
            if raised and "raises-exception" not in cell.metadata.get("tags", []):
                nbformat.write(nb, path)
                raise SystemExit(f"{path}: cell {cell.get('id')} raised (tag it raises-exception if "
                                 f"that is intended):\n{cell.source}")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"executed {path} ({count} code cells)")


def main(argv: list[str]) -> None:
    paths = [Path(p) for p in argv] or sorted(Path(__file__).parent.glob("*.ipynb"))
    for path in paths:
        execute_notebook(path)


if __name__ == "__main__":
    main(sys.argv[1:])
