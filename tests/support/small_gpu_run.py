"""Run the Triton attention as a GPU with 99 KB of shared memory a block would (DGX Spark's GB10, RTX 40xx and
50xx, L40S): Triton is told the device allows 101,376 bytes, so every launch that needs more is refused before
it runs, as there. Each scenario decodes with the triton engine and with the torch attention over the same
weights, and prints one JSON line: how far apart they are and what the backend had to give up.

    python tests/support/small_gpu_run.py [--limit BYTES]

Run in a fresh process: Triton checks a kernel's shared memory once, when it first loads it.
"""
from __future__ import annotations

import argparse
import json

import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.kernels.skinny import stepped_down_configs
from dendrite_nb.testing.shapes import REAL_SHAPES

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SMALL_GPU_SHARED_BYTES = 101_376  # cudaDevAttrMaxSharedMemoryPerBlockOptin of sm_86/sm_89/sm_120 GPUs


def lower_shared_memory_limit(limit: int) -> None:
    """Make Triton believe every device allows `limit` bytes of shared memory a block (its launch check reads
    the driver's device properties)."""
    from triton.runtime import driver

    utils = driver.active.utils
    real = utils.get_device_properties
    utils.get_device_properties = lambda device: {**real(device), "max_shared_mem": limit}


def scenario(dtype: str, leaves: int, prompt_tokens: int, steps: int = 6) -> dict:
    """A 2-layer model with Qwen3-0.6B's attention (16 heads, 8 KV heads of 128), `leaves` leaves forked off a
    prompt of `prompt_tokens` (1: the prompt's own branch), greedy steps on the triton and torch attentions."""
    config = REAL_SHAPES["qwen3-0.6b"].hf_config(num_hidden_layers=2, vocab_size=512)
    fast = Engine.from_random(config, device="cuda", dtype=dtype, num_blocks=2048)
    reference = Engine(fast.model, None, device="cuda", attention="torch", num_blocks=2048)
    prompt = torch.randint(0, 512, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for eng in (fast, reference):
        trunk = eng.new_branch("trunk", prompt)
        branches = eng.fork(trunk, leaves) if leaves > 1 else [trunk]
        # Teacher forcing: both engines append the same tokens, so a near tie in bf16 cannot part them.
        logits = []
        for step in range(steps):
            logits.append(eng.next_logits(branches).float())
            eng.append_many([(branch, [(7 * step + i) % 512]) for i, branch in enumerate(branches)])
        results.append(torch.stack(logits))
        eng.audit()
    got, want = results
    backend = fast.backend
    return {"dtype": dtype, "leaves": leaves, "prompt_tokens": prompt_tokens,
            "relative": ((got - want).norm() / want.norm()).item(), "max_abs": (got - want).abs().max().item(),
            "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
            "unfit_one_tile_widths": sorted(backend.unfit_one_tile_widths(fast.device)),
            "stepped_down": backend.stepped_down_launches(),
            "skinny_stepped_down": stepped_down_configs()}  # this process's so far


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=SMALL_GPU_SHARED_BYTES, help="shared memory bytes a block")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    lower_shared_memory_limit(args.limit)
    for dtype, leaves, prompt_tokens in (("bfloat16", 1, 2000), ("float32", 1, 1000), ("float32", 40, 600)):
        print(json.dumps(scenario(dtype, leaves, prompt_tokens)), flush=True)


if __name__ == "__main__":
    main()
