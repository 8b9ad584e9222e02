"""benchmarks/sampling_step.py --check: every variant (greedy, the torch path, the fused kernels, the race) samples a
tiny vocabulary in Triton's interpreter, its tokens checked against what its settings keep, so the script keeps
working between GPU runs; its table holds each row count's variants with figures consistent with each other."""
from __future__ import annotations

import importlib
import math

import pytest

from tests.support.benchmark_check import BENCHMARKS, run_check



def test_sampling_step_check_times_each_variant_at_each_row_count(tmp_path, monkeypatch, capsys):
    script, returned, printed, table = run_check("sampling_step", ["--step-ms", "2.0"], tmp_path, monkeypatch, capsys)
    variants = ["greedy", "torch", "fused", "fused, top-p only", "race"]
    assert [(r["rows"], r["variant"]) for r in table["rows"]] == [(str(n), v) for n in script.CHECK_ROWS
                                                                 for v in variants]
    for row in table["rows"]:
        assert row["ms"] > 0 and row["floor_ms"] > 0
        assert math.isclose(row["x_floor"], row["ms"] / row["floor_ms"])
        assert math.isclose(row["step_share"], row["ms"] / 2.0)
    assert [line.split(":")[0] for line in returned["notes"] if "% target" in line] == ["1 rows", "4 rows"]


def test_sampling_step_refuses_step_times_that_do_not_match_the_row_counts(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("sampling_step")
    with pytest.raises(SystemExit, match="one per row count"):
        script.main(["--check", "--rows", "1", "4", "16", "--step-ms", "1.0", "2.0"])
