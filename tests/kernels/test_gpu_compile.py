"""The engine's Triton kernels compile for Hopper (sm_90) and consumer Blackwell (sm_120, DGX Spark) in every variant the
backend launches, checked on a machine without either GPU (tests/support/gpu_compile.py says why the interpreter's runs
do not show it)."""
import json

import pytest

from tests.support import gpu_compile_runs
from tests.support.small_gpu_run import SMALL_GPU_SHARED_BYTES

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", gpu_compile_runs.ARCHS)
def test_every_kernel_compiles_in_every_dtype_variant(arch):
    run = gpu_compile_runs.result(arch, timeout_s=900)  # started by tests/conftest.py at collection
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {result["kernel"] for result in results}
    assert kernels == {"decode_tile_attention_kernel", "segment_attention_kernel", "merge_partials_kernel",
                       "_append_kv_kernel", "_rope_qk_kernel", "_gemv_kernel", "_skinny_kernel", "_rms_norm_kernel",
                       "_silu_mul_kernel", "_race_kernel", "_filtered_kernel"}
    assert any("fp8" in result["variant"] for result in results)
    failures = [f"{result['kernel']} ({result['variant']}): {result['error']}" for result in results if result["error"]]
    assert not failures, "\n".join(failures)
    # Where shared memory is short (99 KB a block on sm_120), a decode step can always fall back to 16-row tiles
    # at the backend's own settings, and a bf16 model keeps its 128-wide fused tile; what else does not fit steps
    # down at run time (tests/kernels/test_shared_memory_fallback.py).
    small_gpu_fits = [r for r in results if r["kernel"] == "segment_attention_kernel" and "16 x" in r["variant"]]
    small_gpu_fits += [r for r in results if r["kernel"] == "decode_tile_attention_kernel"
                       and r["variant"].startswith("bf16") and "128-position" in r["variant"]]
    assert len(small_gpu_fits) == 8
    too_big = [f"{r['variant']}: {r['shared_bytes']}" for r in small_gpu_fits if r["shared_bytes"] > SMALL_GPU_SHARED_BYTES]
    assert not too_big, "\n".join(too_big)
