"""Run a GPU benchmark's --check mode (tiny shapes in Triton's interpreter) as the CPU tests do, and check what every
such run must hold: the JSON written equals what main returned, the wall-time line closes the output, and the one
table's title was printed."""
import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_check(script_name: str, args: list[str], tmp_path, monkeypatch, capsys):
    """(the script module, what main returned, the printed output, its one table); skips outside the interpreter."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("--check runs the kernels in Triton's interpreter: TRITON_INTERPRET=1 (the CPU test session's)")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports bench_common from beside it
    script = importlib.import_module(script_name)
    out = tmp_path / f"{script_name}.json"
    returned = script.main(["--check", *args, "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(returned, default=str))
    assert printed.rstrip().splitlines()[-1].startswith(f"{script_name} wall time: ")
    (table,) = returned["tables"]
    assert table["title"] in printed
    return script, returned, printed, table
