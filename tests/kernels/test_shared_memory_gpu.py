"""On a real GPU: the Triton attention with real head sizes where its tuned launches need more shared memory
than the GPU allows. A float32 model's 256-wide fused decode tile needs 270 KB, more than any GPU has; on a GPU
of 99 KB a block (DGX Spark, RTX 40xx/50xx, L40S), a bf16 model's 256-wide tile and float32's wide launches do
not fit either. tests/support/small_gpu_run.py lowers Triton's limit to 99 KB to run the second case on this GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.testing.shapes import REAL_SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32_matmuls")]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SMALL_GPU_RUN = Path(__file__).resolve().parents[1] / "support" / "small_gpu_run.py"


def test_a_float32_model_with_real_heads_decodes_a_long_leaf_as_the_reference_does():
    """One leaf of 2,000 tokens under 8 KV heads of 128 takes the 256-wide fused tile on an H100 or H200 (the
    128-wide one would need more programs than fit); in float32 that tile needs more shared memory than the GPU
    has. The step must run the general kernels instead, inside CUDA graphs as outside, and match torch."""
    config = REAL_SHAPES["qwen3-0.6b"].hf_config(num_hidden_layers=2, vocab_size=512)
    fast = Engine.from_random(config, device="cuda", dtype="float32", num_blocks=512)
    reference = Engine(fast.model, None, device="cuda", attention="torch", num_blocks=512)
    prompt = torch.randint(0, 512, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    results = []
    for eng in (fast, reference):
        branch = eng.new_branch("leaf", prompt)
        tokens = eng.generate([branch], 8, GREEDY)[0]
        results.append((tokens, eng.next_logits([branch])))
        eng.audit()
    (got_tokens, got_logits), (want_tokens, want_logits) = results
    assert got_tokens == want_tokens
    assert (got_logits - want_logits).abs().max() < 1e-3
    assert fast.backend.unfit_one_tile_widths(fast.device), "the step never reached a fused width that does not fit"


def test_a_99_kb_gpu_runs_every_launch_kind_as_the_reference_does(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SMALL_GPU_RUN)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = {(r["dtype"], r["leaves"]): r for r in map(json.loads, run.stdout.splitlines())}
    bf16_leaf, float32_leaf, float32_tree = results[("bfloat16", 1)], results[("float32", 1)], results[("float32", 40)]
    assert bf16_leaf["unfit_one_tile_widths"] == [256]  # 135 KB; the 128-wide tile (70 KB) fits
    assert float32_leaf["unfit_one_tile_widths"]  # 139 KB at 128 wide, 270 KB at 256
    assert float32_tree["stepped_down"], "the shared prefix's wide float32 launch (164 KB) must have stepped down"
    assert float32_tree["skinny_stepped_down"], "40 rows' float32 products (skinny, in graphs) must have stepped down"
    assert bf16_leaf["relative"] < 2e-2
    for result in (float32_leaf, float32_tree):
        assert result["max_abs"] < 1e-3 and result["argmax_equal"]
