"""benchmarks/fp8_products.py --check: every variant of the fp8-weight benchmark runs on tiny shapes in Triton's
interpreter and is checked against the float32 reference, so the script keeps working between GPU runs."""
from __future__ import annotations

import math


from tests.support.benchmark_check import run_check



def test_fp8_products_check_runs_each_kernel_and_the_library_path(tmp_path, monkeypatch, capsys):
    script, returned, printed, table = run_check("fp8_products", [], tmp_path, monkeypatch, capsys)
    rows = table["rows"]
    # Each product of the tiny model at each row count: gemv at 1 row, skinny at 4 (the norm folded) and 64,
    # the library beyond, for the weight in x's dtype and for fp8 alike.
    assert [(r["product"], r["rows"]) for r in rows] == [(p, n) for p in script.TINY for n in script.CHECK_ROWS]
    assert [r["fp8_kernel"] for r in rows] == [r["base_kernel"] for r in rows] == \
        ["gemv", "skinny", "skinny", "cublas"] * len(script.TINY)
    for row in rows:
        assert row["base_us"] > 0 and row["fp8_us"] > 0 and row["scaled_mm_us"] > 0  # CPU torch has _scaled_mm
        assert math.isclose(row["fp8_speedup"], row["base_us"] / row["fp8_us"])
        out_features, width = map(int, row["shape"].split(" x "))
        assert math.isclose(row["fp8_gbps"], (out_features * width + 4 * out_features) / row["fp8_us"] / 1e3)
        assert math.isclose(row["base_gbps"], out_features * width * 4 / row["base_us"] / 1e3)  # float32 here
