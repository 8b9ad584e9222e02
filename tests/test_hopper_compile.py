"""The GPU kernels compile for a Hopper GPU (sm_90) in every variant the backend launches, checked on a machine
without one (tests/hopper_compile.py says why the interpreter's runs do not show it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).with_name("hopper_compile.py")


def test_attention_rope_and_append_kernels_compile_for_sm90_in_every_dtype_variant(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile afresh: a cached kernel would pass without compiling
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {result["kernel"] for result in results}
    assert kernels == {"decode_tile_attention_kernel", "segment_attention_kernel", "merge_partials_kernel",
                       "_append_kv_kernel", "_rope_qk_kernel"}
    assert any("fp8" in result["variant"] for result in results)
    failures = [f"{result['kernel']} ({result['variant']}): {result['error']}" for result in results if result["error"]]
    assert not failures, "\n".join(failures)
