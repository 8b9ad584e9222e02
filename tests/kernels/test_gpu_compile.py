"""The engine's Triton kernels compile for Hopper (sm_90) and consumer Blackwell (sm_120, DGX Spark) in every variant the
backend launches, checked on a machine without either GPU (tests/support/gpu_compile.py says why the interpreter's runs
do not show it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.small_gpu_run import SMALL_GPU_SHARED_BYTES

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "gpu_compile.py"


ARCHS = (90, 120)


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """Both architectures' compiles, started together: each is one single-threaded process of minutes, and CI's
    two cores would otherwise run them one after the other."""
    started = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(f"sm{arch}")
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(folder / "cache")  # compile afresh: a cached kernel would pass without compiling
        out, err = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")
        started[arch] = (subprocess.Popen([sys.executable, str(SCRIPT), "--arch", str(arch)], env=env, stdout=out,
                                          stderr=err, text=True), out, err)
    yield started
    for process, out, err in started.values():
        if process.poll() is None:
            process.kill()
        out.close()
        err.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_in_every_dtype_variant(arch, compiles):
    process, out, err = compiles[arch]
    process.wait(timeout=900)
    out.seek(0)
    err.seek(0)
    run = subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {result["kernel"] for result in results}
    assert kernels == {"decode_tile_attention_kernel", "segment_attention_kernel", "merge_partials_kernel",
                       "_append_kv_kernel", "_rope_qk_kernel", "_gemv_kernel", "_skinny_kernel", "_rms_norm_kernel",
                       "_silu_mul_kernel", "_race_kernel"}
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
