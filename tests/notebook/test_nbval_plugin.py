"""dendrite_nb.magics.nbval_plugin: under `pytest --nbval`, cells get their metadata in the execute_request
(as in JupyterLab) and display updates are applied before outputs are compared. Each notebook cell
passes with the plugin and fails without it."""
import os
import re
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

pytest.importorskip("nbval")

PLUGIN = "dendrite_nb.magics.nbval_plugin"


def write_notebook(path):
    cells = [
        new_code_cell(
            'from IPython import get_ipython; print(get_ipython().kernel.get_parent()["metadata"].get("dendrite"))',
            metadata={"dendrite": {"regex": "a+"}, "tags": []},
            execution_count=1,
            outputs=[new_output("stream", name="stdout", text="{'regex': 'a+'}\n")],
        ),
        new_code_cell(
            'h = display("first", display_id=True); h.update("final")',
            execution_count=2,
            # as the front end saves it: the final content, the transient display_id dropped
            outputs=[new_output("display_data", data={"text/plain": "'final'"})],
        ),
        new_code_cell(
            'md = get_ipython().kernel.get_parent()["metadata"]; print(md["cellId"], md["tags"], md["deletedCells"])',
            metadata={"tags": ["x"]},
            execution_count=3,
            outputs=[new_output("stream", name="stdout", text="cell-with-id ['x'] []\n")],
        ),
    ]
    cells[2].id = "cell-with-id"
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.validate(nb)
    nbformat.write(nb, str(path))


def run_nbval(tmp_path, *plugin_args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    # -c /dev/null and --rootdir: no pytest config (the repo's pyproject included) applies. The other installed
    # plugins stay out: hypothesis's header under -v and the unraisable-exception plugin's closing garbage
    # collections (with torch imported) took 5 of each run's 15 s.
    quiet = [arg for name in ("hypothesispytest", "benchmark", "anyio", "unraisableexception")
             for arg in ("-p", f"no:{name}")]
    cmd = [sys.executable, "-m", "pytest", "--nbval", *plugin_args, "-p", "no:cacheprovider", *quiet,
           "-c", os.devnull, "--rootdir", str(tmp_path), "-v", "nb.ipynb"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    results = dict(re.findall(r"::Cell (\d+) (PASSED|FAILED)", out))
    return proc.returncode, results, out


def test_nbval_plugin_forwards_cell_metadata_and_applies_display_updates(tmp_path):
    write_notebook(tmp_path / "nb.ipynb")
    rc, results, out = run_nbval(tmp_path, "-p", PLUGIN)
    assert rc == 0, out
    assert results == {"0": "PASSED", "1": "PASSED", "2": "PASSED"}, out

    # without the plugin: no metadata reaches the kernel, and nbval compares the first display ('first')
    rc, results, out = run_nbval(tmp_path)
    assert rc == 1, out
    assert results == {"0": "FAILED", "1": "FAILED", "2": "FAILED"}, out
    assert "'first'" in out and "unhandled iopub msg: update_display_data" in out, out
