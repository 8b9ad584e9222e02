"""Launch settings of the fused decode attention (attention/triton_decode_kernel.py) on whole decode steps.

For one 0.6B-shaped leaf (decode_step.py's case (b)) at several context lengths, and each (BLOCK_N,
num_warps) of the fused launch: the step time inside generate(leaf, --steps) with CUDA graphs (median of ROUNDS
calls, the variants taking turns), and the step's decoder graph alone, replayed back to back (device time: the
step above also holds the host's work, which hides the GPU's where the host is the slower of the two). Beside
them, in the same run, the general path of three launches per layer (RoPE + append, attention, merge; the
fused path's two are RoPE + append + attention, then the merge), and the floor (weights + the leaf's KV over
the copy bandwidth measured here).

    python benchmarks/tune_one_tile.py [--contexts 512 2048 8192] [--launches 128,8 64,4 ...] [--steps 20]

The first fused row, "default", is the engine's own choice of tile for that context (attention/triton_backend.py).
"""
from __future__ import annotations

import functools
import statistics

import torch

from bench_common import (build_model, engine_variant, free_memory, log, measure_floors, model_costs, parser,
                          per_replay_seconds, random_ids, setup as make_setup, time_calls)
from dendrite_nb import SamplingParams
from dendrite_nb.attention.triton_tuning import ONE_TILE_PROGRAMS_PER_SM, ONE_TILE_WARPS, ONE_TILE_WIDTHS

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
LAUNCHES = [(64, 4), (128, 4), (128, 8)]
ROUNDS = 5  # every variant's generate call once per round, round after round: drift hits them all alike
BLOCK_SIZE = 16


def warm_engine(model, setup, context: int, steps: int, launch: tuple[int, int] | str | None):
    """(engine, leaf) after one untimed generate(leaf, steps): compiles and captures. launch: (BLOCK_N, num_warps)
    of the fused launch; "default": the engine's own choice by context; None: the general three launches."""
    engine, reason = engine_variant(model, setup, "triton", True, block_size=BLOCK_SIZE,
                                    num_blocks=(context + (ROUNDS + 2) * steps) // BLOCK_SIZE + 8)
    if engine is None:
        raise SystemExit(f"the triton engine cannot run here: {reason}")
    if launch is None:
        engine.backend.one_tile_programs_per_sm = 0
    elif launch != "default":
        engine.backend.one_tile_launch = launch
    leaf = engine.new_branch("leaf", random_ids(context, model.config.vocab_size, seed=1))
    engine.generate([leaf], steps, GREEDY)
    return engine, leaf


def last_capture(engine):
    """The decode graph the engine replayed last (one leaf: the smallest bucket), with its plan shape."""
    return list(engine._graphs._graphs.values())[-1]


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    arguments.add_argument("--launches", nargs="+", default=[f"{n},{w}" for n, w in LAUNCHES],
                           help="BLOCK_N,num_warps pairs")
    arguments.add_argument("--steps", type=int, default=20)
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("tune_one_tile.py times CUDA graphs of the fused decode kernel: run it on a GPU.")
    sms = torch.cuda.get_device_properties(setup.device).multi_processor_count
    launches = ["default"] + [tuple(int(part) for part in text.split(",")) for text in args.launches]
    floors = measure_floors(setup, matmul=False)
    model = build_model(setup, setup.hf_config("qwen3-0.6b"))
    costs = model_costs(model, setup.dtype)
    log(f"default: tiles of {' or '.join(map(str, ONE_TILE_WIDTHS))} positions by context, {ONE_TILE_WARPS} warps; "
        f"copy bandwidth {floors.copy_bytes_per_s / 1e9:,.0f} GB/s")
    log(f"{'context':>8} {'launch':>16} {'step ms':>8} {'x floor':>8} {'vs 3 launches':>14} {'graph ms':>8} "
        f"{'vs 3 launches':>14}")
    for context in args.contexts:
        floor_ms = floors.seconds(costs.weight_bytes + costs.kv_bytes(context + ROUNDS * args.steps // 2), 0) * 1e3
        variants = [None, *launches]
        engines = [warm_engine(model, setup, context, args.steps, launch) for launch in variants]
        times = [[] for _ in variants]
        for _ in range(ROUNDS):
            for (engine, leaf), seconds in zip(engines, times):
                seconds += time_calls(functools.partial(engine.generate, [leaf], args.steps, GREEDY), setup.device, 1)
        ms = [statistics.median(seconds) / args.steps * 1e3 for seconds in times]
        graph_ms = [per_replay_seconds(last_capture(engine).graph.replay, 200) * 1e3 for engine, _ in engines]
        for (engine, _), launch, step, graph in zip(engines, variants, ms, graph_ms):
            if launch is None:
                name, note = "3 launches", ""
            elif launch == "default":
                tile = last_capture(engine).shape.one_tile  # the last step's plan, as replayed
                choice = f"{tile}, {ONE_TILE_WARPS}w" if tile else "the general path"
                name, note = "default", f"  (the engine's choice now: {choice})"
            else:
                name = f"{launch[0]}, {launch[1]}w"
                programs = -(-(context + ROUNDS * args.steps) // launch[0]) * model.config.num_kv_heads
                note = "" if programs <= ONE_TILE_PROGRAMS_PER_SM * sms else "  (too many tiles: the general path ran)"
            log(f"{context:8d} {name:>16} {step:8.3f} {step / floor_ms:8.2f} {ms[0] / step:13.2f}x "
                f"{graph:8.3f} {graph_ms[0] / graph:13.2f}x{note}")
        del engines
        free_memory(setup.device)


if __name__ == "__main__":
    main()
