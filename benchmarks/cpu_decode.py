"""A decode step on the CPU (float32 by default): the engine's CPU path against the reference path and transformers.

The engine on a CPU runs the plain-torch model. Two parts of its step are measured on and off here:
  attention  torch-tree: a shared tree node's KV gathered once for all the leaves under it, one product against
             all their query heads (attention/torch_tree_backend.py; attention="auto" off CUDA), against
             torch: the flat reference, every leaf gathering its whole context;
  products   W @ x.T for 2-64 rows (model/dense.py), against F.linear (x @ W.T).
"torch + F.linear" is the engine's CPU path before 2026-11-25. Peer in the same run: transformers' model of the
same config on the same weight tensors, one step for the same batch from a prefilled DynamicCache (the prefix
repeated to every leaf, as HF holds it), greedy, like the engine's steps here.

Cases: 1 leaf with a 512-token context, and 5 and 16 leaves forked off a 512-token prefix with 16 tokens each
of their own (best-of-n or a tree-of-thought level). Step: median of 3 generate(leaves, --steps) calls / steps.
Floor: the bytes a step must read once (the weights, the tied embedding as the LM head, the prefix's KV once
and each leaf's own) over the copy bandwidth measured here on 512 MiB (read + write, out of cache), or the
step's FLOPs at the float32 matmul rate measured here (n = 1,024) if that is larger (on two cores it is, from about 8 leaves).

    python benchmarks/cpu_decode.py [--shape qwen3-0.6b] [--leaves 1 5 16] [--steps 4] [--dtype bfloat16] [--no-hf]
                                    [--json PATH] [--smoke]

--dtype bfloat16 (default float32) times the same step in bf16, transformers too; W @ x.T acts on float32 only,
so there the two product settings are one (F.linear).
"""
from __future__ import annotations

import contextlib
import functools
import statistics

import torch

from bench_common import (DTYPE_NAMES, Column, Report, Setup, build_model, log, measure_floors, model_costs, parser,
                          random_ids, time_calls)
from decode_step import Case, hf_step_seconds, num_blocks
from dendrite_nb import Engine, SamplingParams
from dendrite_nb.model import dense

CALLS = 3
PREFIX, OWN = 512, 16
SMOKE_PREFIX, SMOKE_OWN = 80, 4  # the smoke prefix passes the 64 tokens from which a node is read shared
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
VARIANTS = [("torch-tree", True), ("torch", True), ("torch-tree", False), ("torch", False)]  # (attention, W @ x.T)


@contextlib.contextmanager
def products_through_linear(enabled: bool):
    """With enabled, every product goes through F.linear, as before model/dense.py."""
    saved = dense.MAX_ROWS
    dense.MAX_ROWS = 0 if enabled else saved
    try:
        yield
    finally:
        dense.MAX_ROWS = saved


def engine_step_seconds(model, setup: Setup, attention: str, case: Case, prefix_ids, own_ids, steps: int):
    engine = Engine(model, None, device=setup.device, attention=attention, block_size=16,
                    num_blocks=num_blocks(case, (CALLS + 1) * steps + 2))
    root = engine.new_branch("prefix", prefix_ids)
    leaves = [root]
    if case.leaves > 1:
        leaves = engine.fork(root, case.leaves)
        engine.append_many(zip(leaves, own_ids))
    in_call = time_calls(functools.partial(engine.generate, leaves, steps, GREEDY), setup.device, CALLS, warmup=1)
    return [t / steps for t in in_call]


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "llama-3.2-1b"])
    arguments.add_argument("--leaves", type=int, nargs="+", default=None, help="default 1 5 16 (smoke: 1 4)")
    arguments.add_argument("--steps", type=int, default=None, help="steps per timed call (default 4; smoke 2)")
    arguments.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = arguments.parse_args(argv)
    dtype = DTYPE_NAMES[args.dtype or "float32"]
    setup = Setup(torch.device("cpu"), dtype, args.smoke)
    # W @ x.T (model/dense.py) acts on float32 only: in other dtypes both product settings are F.linear.
    variants = VARIANTS if dtype == torch.float32 else [(attention, False) for attention, on in VARIANTS if on]
    steps = args.steps or (2 if setup.smoke else 4)
    prefix, own = (SMOKE_PREFIX, SMOKE_OWN) if setup.smoke else (PREFIX, OWN)
    report = Report("cpu_decode", setup)
    report.floors = floors = measure_floors(setup)
    hf_config = setup.hf_config(args.shape)
    model = build_model(setup, hf_config)
    costs = model_costs(model, setup.dtype)
    shape = setup.shape_name(args.shape)
    dtype_name = str(dtype).removeprefix("torch.")
    table = report.table(f"CPU decode step, {shape}, {dtype_name} (median of {CALLS} generate(leaves, {steps}) calls / "
                         f"{steps}; floor: bytes read once / copy bandwidth, or FLOPs / matmul rate if larger)",
                         [Column("leaves", "leaves", label=True), Column("attention", "attention", label=True),
                          Column("products", "products", label=True), Column("step_ms", "step ms", "{:.1f}"),
                          Column("floor_ms", "floor ms", "{:.1f}"), Column("x_floor", "x floor", "{:.2f}"),
                          Column("vs_hf", "HF / step", "{:.2f}x")])
    vocab = model.config.vocab_size
    prefix_ids = random_ids(prefix, vocab, seed=1)
    for leaves in args.leaves or ([1, 4] if setup.smoke else [1, 5, 16]):
        case = Case(str(leaves), args.shape, prefix, leaves, own if leaves > 1 else 0, 0.0)
        own_ids = random_ids(case.own, vocab, seed=2, rows=leaves) if leaves > 1 else []
        own_mid = case.own + steps + (CALLS * steps) // 2 + 1   # own tokens at the median timed step
        context = prefix + own_mid
        floor_s = floors.seconds(costs.weight_bytes + costs.kv_bytes(prefix + leaves * own_mid),
                                 leaves * costs.prefill_flops(1, context - 1))
        log(f"\n{leaves} leaf/leaves under {prefix} tokens: floor {floor_s * 1e3:.1f} ms")
        hf_ms = None
        if not args.no_hf:
            hf_times, reason = hf_step_seconds(model, hf_config, setup, case, prefix_ids, own_ids, steps, warmup=1,
                                               cache_bytes=0)
            hf_ms = statistics.median(hf_times) * 1e3
        for attention, transposed in variants:
            with products_through_linear(not transposed):
                step_ms = statistics.median(engine_step_seconds(model, setup, attention, case, prefix_ids, own_ids,
                                                                steps)) * 1e3
            products = "W @ x.T" if transposed else "F.linear"
            table.add(leaves=str(leaves), attention=attention, products=products, step_ms=step_ms,
                      floor_ms=floor_s * 1e3, x_floor=step_ms / (floor_s * 1e3), vs_hf=hf_ms / step_ms if hf_ms else None)
            log(f"  {attention:>10} + {products:<8}: {step_ms:8.1f} ms/step ({step_ms / (floor_s * 1e3):.2f}x floor)")
        if hf_ms is not None:
            table.add(leaves=str(leaves), attention="transformers", products="F.linear", step_ms=hf_ms,
                      floor_ms=floor_s * 1e3, x_floor=hf_ms / (floor_s * 1e3), vs_hf=1.0)
            log(f"  transformers (DynamicCache): {hf_ms:8.1f} ms/step")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
