"""Launch settings of the fused decode attention (attention/triton_decode_kernel.py) on whole decode steps.

For one 0.6B-shaped leaf (decode_step.py's case (b)) at several context lengths, each variant's step time inside
generate(leaf, --steps) with CUDA graphs (median of ROUNDS calls, the variants taking turns), and the step's
decoder graph alone, replayed back to back (device time: the step above also holds the host's work, which
hides the GPU's where the host is the slower of the two). The variants, in the same run:
- "3 launches": the general path per layer (RoPE + append, attention, merge);
- "fused N, Ww": the fused launch (RoPE + append + attention) with BLOCK_N N and W warps, then the merge kernel;
- "o_proj merges B,K,W": the fused launch (default settings), its merge left to the o_proj GEMV
  (kernels.gemv_of_partials) with BLOCK_N B, BLOCK_K K and W warps: two launches a layer fewer than 3.
Beside them, the floor (weights + the leaf's KV over the copy bandwidth measured here).

    python benchmarks/tune_one_tile.py [--contexts 512 2048] [--launches 128,8 64,4 ...]
                                       [--partials 4,2048,8 8,1024,8 ...] [--steps 20]
"""
from __future__ import annotations

import functools
import importlib
import statistics

import torch

from bench_common import (build_model, engine_variant, free_memory, log, measure_floors, model_costs, parser,
                          per_replay_seconds, random_ids, setup as make_setup, time_calls)
from dendrite_nb import SamplingParams
from dendrite_nb.attention.triton_backend import MERGE_IN_PRODUCT_SLOTS, ONE_TILE_LAUNCH, ONE_TILE_PROGRAMS_PER_SM

# The module, not the function that dendrite_nb.kernels exports under the same name.
gemv_module = importlib.import_module("dendrite_nb.kernels.gemv")

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
LAUNCHES = ["128,8"]
PARTIALS = ["4,2048,8", "8,2048,8", "8,1024,8", "16,1024,8"]
ROUNDS = 5  # every variant's generate call once per round, round after round: drift hits them all alike
BLOCK_SIZE = 16


def warm_engine(model, setup, context: int, steps: int, variant: tuple[str, tuple[int, ...] | None]):
    """(engine, leaf) after one untimed generate(leaf, steps): compiles and captures. variant: ("general", None),
    ("fused", (BLOCK_N, num_warps)) or ("partials", (BLOCK_N, BLOCK_K, num_warps)) of the module docstring."""
    kind, settings = variant
    engine, reason = engine_variant(model, setup, "triton", True, block_size=BLOCK_SIZE,
                                    num_blocks=(context + (ROUNDS + 2) * steps) // BLOCK_SIZE + 8)
    if engine is None:
        raise SystemExit(f"the triton engine cannot run here: {reason}")
    if kind == "general":
        engine.backend.one_tile_programs_per_sm = 0
    elif kind == "fused":
        engine.backend.one_tile_launch = settings
        engine.backend.merge_in_product_slots = 0
    # The o_proj GEMV's launch is read when the graph is captured, below: set for this engine's capture only.
    gemv_module.PARTIALS_CONFIG = (*settings, 3) if kind == "partials" else None
    try:
        leaf = engine.new_branch("leaf", random_ids(context, model.config.vocab_size, seed=1))
        engine.generate([leaf], steps, GREEDY)
    finally:
        gemv_module.PARTIALS_CONFIG = None
    return engine, leaf


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def variant_name(variant) -> str:
    kind, settings = variant
    if kind == "general":
        return "3 launches"
    if kind == "fused":
        return f"fused {settings[0]}, {settings[1]}w"
    return "o_proj merges " + ",".join(map(str, settings))


def decoder_graph(engine):
    """The decode graph the engine replayed last (one leaf: the smallest bucket)."""
    return list(engine._graphs._graphs.values())[-1].graph


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--contexts", nargs="+", type=int, default=[512, 2048])
    arguments.add_argument("--launches", nargs="+", default=LAUNCHES, help="BLOCK_N,num_warps of the fused launch")
    arguments.add_argument("--partials", nargs="+", default=PARTIALS,
                           help="BLOCK_N,BLOCK_K,num_warps of the o_proj GEMV that merges the partials")
    arguments.add_argument("--steps", type=int, default=20)
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("tune_one_tile.py times CUDA graphs of the fused decode kernel: run it on a GPU.")
    sms = torch.cuda.get_device_properties(setup.device).multi_processor_count
    variants = [("general", None), *[("fused", numbers(t)) for t in args.launches],
                *[("partials", numbers(t)) for t in args.partials]]
    floors = measure_floors(setup, matmul=False)
    model = build_model(setup, setup.hf_config("qwen3-0.6b"))
    costs = model_costs(model, setup.dtype)
    log(f"default ONE_TILE_LAUNCH {ONE_TILE_LAUNCH}, MERGE_IN_PRODUCT_SLOTS {MERGE_IN_PRODUCT_SLOTS}; "
        f"copy bandwidth {floors.copy_bytes_per_s / 1e9:,.0f} GB/s")
    log(f"{'context':>8} {'variant':>26} {'step ms':>8} {'x floor':>8} {'vs 3 launches':>14} {'graph ms':>8} "
        f"{'vs 3 launches':>14}")
    for context in args.contexts:
        floor_ms = floors.seconds(costs.weight_bytes + costs.kv_bytes(context + ROUNDS * args.steps // 2), 0) * 1e3
        engines = [warm_engine(model, setup, context, args.steps, variant) for variant in variants]
        times = [[] for _ in variants]
        for _ in range(ROUNDS):
            for (engine, leaf), seconds in zip(engines, times):
                seconds += time_calls(functools.partial(engine.generate, [leaf], args.steps, GREEDY), setup.device, 1)
        ms = [statistics.median(seconds) / args.steps * 1e3 for seconds in times]
        graph_ms = [per_replay_seconds(decoder_graph(engine).replay, 200) * 1e3 for engine, _ in engines]
        tiles = -(-(context + ROUNDS * args.steps) // ONE_TILE_LAUNCH[0])
        for variant, step, graph in zip(variants, ms, graph_ms):
            kind, settings = variant
            block_n = settings[0] if kind == "fused" else ONE_TILE_LAUNCH[0]
            programs = -(-(context + ROUNDS * args.steps) // block_n) * model.config.num_kv_heads
            note = ""
            if kind != "general" and programs > ONE_TILE_PROGRAMS_PER_SM * sms:
                note = "  (too many tiles: the general path ran)"
            elif kind == "partials" and tiles > MERGE_IN_PRODUCT_SLOTS:
                note = "  (too many slots: the merge kernel ran)"
            log(f"{context:8d} {variant_name(variant):>26} {step:8.3f} {step / floor_ms:8.2f} {ms[0] / step:13.2f}x "
                f"{graph:8.3f} {graph_ms[0] / graph:13.2f}x{note}")
        del engines
        free_memory(setup.device)


if __name__ == "__main__":
    main()
