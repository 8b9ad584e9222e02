"""A steady decode step by batch size and sampler, and a search made of short calls against one long call.

Qwen3-0.6B shape (random weights, bf16 on a GPU): B leaves forked off a 512-token prefix, 16 tokens each of their own.
  steady step   generate(copies, --steps) / --steps, median of CALLS calls, each on fresh one-child forks of the
                leaves (pruned after) once one such call has captured their CUDA graphs, for B in --leaves, greedy and with
                the search sampler (temperature 0.8, top-k 50, top-p 0.9, plus min-p 0.05 where SamplingParams has
                it). Targets (issue 42): a step of B <= 64 leaves at most 1.3x the one-leaf greedy step; sampling
                at most ~5% over greedy at the same B.
  short calls   the same B leaves decoding --rounds rounds of generate(leaves, --short) each followed by a fork
                of the first leaf and a prune of the last (B stays the same): seconds per decoded step, against
                one generate(leaves, rounds x short) call's, both on copies and run once untimed first (a long
                search meets its shapes again and keeps their graphs). Target: at most 1.10x.
Each row counts the CUDA graph captures inside its timed calls: 0 means every figure is of replayed graphs.
Floor: the weights (every one but the embedding table) + the prefix's KV once + each leaf's own KV, over the copy
bandwidth measured in the same run. The peer for the same steps at 0.6B is decode_step.py's case (b).

    python benchmarks/batch_scaling.py [--leaves 1 2 4 8 16 32 64] [--steps 32] [--short 4] [--rounds 8]
                                       [--weights fp8] [--json PATH] [--smoke]
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from bench_common import (Column, Report, build_model, engine_variant, free_memory, generate_on_copies, log,
                          measure_floors, model_costs, parser, random_ids, setup as make_setup, sync)
from dendrite_nb import SamplingParams
from dendrite_nb.model.quantized_linear import quantize_model

CALLS = 3
PREFIX, OWN = 512, 16
SMOKE_PREFIX, SMOKE_OWN = 24, 4
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SEARCH_FIELDS = dict(temperature=0.8, top_k=50, top_p=0.9, ignore_eos=True)
STEP_TARGET, SAMPLING_TARGET, SHORT_CALLS_TARGET = 1.3, 1.05, 1.10


def search_sampler() -> SamplingParams:
    """The sampler a search uses; min-p too where this engine has it."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**SEARCH_FIELDS, **({"min_p": 0.05} if "min_p" in names else {}))


def leaves_of(engine, count: int, prefix_ids, own_ids):
    root = engine.new_branch("prefix", prefix_ids)
    if count == 1:
        return [root]
    leaves = engine.fork(root, count)
    engine.append_many(zip(leaves, own_ids[:count]))
    return leaves


def graph_captures(engine) -> int:
    graphs = engine._graphs
    return graphs.captures if graphs is not None else 0


def steady_step_seconds(engine, leaves, steps: int, sampling: SamplingParams, device) -> tuple[float, int]:
    """(seconds per step, CUDA graph captures inside the timed calls): the median of CALLS generate(steps)
    calls on fresh copies of the leaves, after one such call that captures their shapes."""
    generate_on_copies(engine, leaves, steps, sampling, device, repeats=0, warmup=1)
    captures = graph_captures(engine)
    times = generate_on_copies(engine, leaves, steps, sampling, device, repeats=CALLS, warmup=0)
    return statistics.median(times) / steps, graph_captures(engine) - captures


def short_calls_search(engine, leaves, short: int, rounds: int, sampling: SamplingParams, device) -> float:
    """Seconds per decoded step of a search on copies of the leaves: `rounds` of generate(short) + fork the
    first leaf + prune the last (the batch stays the same size); every branch it made is pruned after."""
    branches = [engine.fork(leaf, 1)[0] for leaf in leaves]
    sync(device)
    started = time.perf_counter()
    for _ in range(rounds):
        engine.generate(branches, short, sampling)
        if len(branches) > 1:
            child, = engine.fork(branches[0], 1)
            engine.prune(branches.pop())
            branches.append(child)
    sync(device)
    seconds = time.perf_counter() - started
    engine.prune(branches)
    return seconds / (rounds * short)


def short_calls_step_seconds(engine, leaves, short: int, rounds: int, sampling: SamplingParams,
                             device) -> tuple[float, int]:
    """(seconds per step, captures inside the timed search) of short_calls_search, run once untimed first: a
    search that goes on for long meets the same shapes again, and its graphs (up to cuda_graphs.MAX_GRAPHS)
    are kept."""
    short_calls_search(engine, leaves, short, rounds, sampling, device)
    captures = graph_captures(engine)
    seconds = short_calls_search(engine, leaves, short, rounds, sampling, device)
    return seconds, graph_captures(engine) - captures


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--leaves", type=int, nargs="+", default=None, help="default 1 2 4 8 16 32 64 (smoke: 1 4)")
    arguments.add_argument("--steps", type=int, default=None, help="steps per steady call (default 32; smoke 2)")
    arguments.add_argument("--short", type=int, default=4, help="steps per call of the short-call search")
    arguments.add_argument("--rounds", type=int, default=None, help="short calls per search (default 8; smoke 2)")
    arguments.add_argument("--weights", choices=["fp8", "int8", "int4"], default=None,
                           help="quantize the weights first (Engine weights=...); the floor counts their bytes")
    arguments.add_argument("--attention", default="auto", help="the engines' attention backend (default auto)")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    counts = args.leaves or ([1, 4] if setup.smoke else [1, 2, 4, 8, 16, 32, 64])
    steps = args.steps or (2 if setup.smoke else 32)
    rounds = args.rounds or (2 if setup.smoke else 8)
    prefix, own = (SMOKE_PREFIX, SMOKE_OWN) if setup.smoke else (PREFIX, OWN)
    report = Report("batch_scaling", setup)
    report.floors = floors = measure_floors(setup)
    model = build_model(setup, setup.hf_config("qwen3-0.6b"))
    if args.weights:
        quantize_model(model, args.weights)
    costs = model_costs(model, setup.dtype)
    vocab = model.config.vocab_size
    prefix_ids = random_ids(prefix, vocab, seed=1)
    own_ids = random_ids(own, vocab, seed=2, rows=max(counts))
    sampler = search_sampler()
    weights = args.weights or str(setup.dtype).removeprefix("torch.")
    log(f"qwen3-0.6b ({weights} weights {costs.weight_bytes / 1e9:.3f} GB), {prefix}-token prefix, {own} own tokens "
        f"a leaf; sampler {sampler}")
    table = report.table(f"steady decode step by leaves (median of {CALLS} generate(leaves, {steps}) / {steps}); "
                         f"short calls: {rounds} x generate(leaves, {args.short}) + fork + prune, per step",
                         [Column("leaves", "leaves", label=True), Column("weights", "weights", label=True),
                          Column("greedy_ms", "greedy ms", "{:.3f}"), Column("x_one_leaf", "x 1-leaf", "{:.2f}"),
                          Column("sampled_ms", "sampled ms", "{:.3f}"), Column("x_greedy", "sampled / greedy", "{:.3f}"),
                          Column("short_ms", "short calls ms", "{:.3f}"), Column("x_long", "short / long", "{:.3f}"),
                          Column("floor_ms", "floor ms", "{:.3f}"), Column("captures", "graph captures")])
    one_leaf_ms = None
    for count in counts:
        # Room per leaf for its own tokens and one call's copy (the longest: the long call), whose first write
        # copies the leaf's shared last block, with blocks to spare for the search's forks.
        tokens = own + max(steps, rounds * args.short) + 2 * BLOCK_SIZE
        engine, reason = engine_variant(model, setup, args.attention, None, block_size=BLOCK_SIZE,
                                        num_blocks=-(-prefix // BLOCK_SIZE) + (count + 1) * (-(-tokens // BLOCK_SIZE) + 2) + 8)
        label = {"leaves": count, "weights": weights}
        if engine is None:
            table.add(**label, unavailable=reason)
            continue
        leaves = leaves_of(engine, count, prefix_ids, own_ids)
        greedy, captures = steady_step_seconds(engine, leaves, steps, GREEDY, setup.device)
        sampled, sampled_captures = steady_step_seconds(engine, leaves, steps, sampler, setup.device)
        long_call, long_captures = steady_step_seconds(engine, leaves, rounds * args.short, sampler, setup.device)
        short, short_captures = short_calls_step_seconds(engine, leaves, args.short, rounds, sampler, setup.device)
        captures += sampled_captures + long_captures + short_captures
        context = prefix + own + steps // 2   # a leaf's mean context over a steady call
        floor_s = floors.seconds(costs.weight_bytes + costs.kv_bytes(prefix + count * (context - prefix)), 0.0)
        one_leaf_ms = one_leaf_ms if one_leaf_ms is not None else (greedy * 1e3 if count == 1 else None)
        row = table.add(**label, greedy_ms=greedy * 1e3, sampled_ms=sampled * 1e3, x_greedy=sampled / greedy,
                        x_one_leaf=greedy * 1e3 / one_leaf_ms if one_leaf_ms else None, short_ms=short * 1e3,
                        x_long=short / long_call, floor_ms=floor_s * 1e3, captures=captures)
        log(f"  {count:>3} leaves: greedy {row['greedy_ms']:.3f} ms, sampled {row['sampled_ms']:.3f} ms "
            f"({row['x_greedy']:.3f}x), short calls {row['short_ms']:.3f} ms ({row['x_long']:.3f}x a long call); "
            f"{captures} CUDA graph captures inside the timed calls")
        del engine, leaves
        free_memory(setup.device)
    measured = [r for r in table.rows if "unavailable" not in r]
    if measured and one_leaf_ms:
        worst = max(measured, key=lambda r: r["x_one_leaf"])
        report.note(f"worst step / one-leaf step: {worst['x_one_leaf']:.2f}x at {worst['leaves']} leaves "
                    f"(target <= {STEP_TARGET}x)")
    if measured:
        worst = max(measured, key=lambda r: r["x_greedy"])
        report.note(f"worst sampled / greedy: {worst['x_greedy']:.3f}x at {worst['leaves']} leaves "
                    f"(target <= {SAMPLING_TARGET}x)")
        worst = max(measured, key=lambda r: r["x_long"])
        report.note(f"worst short calls / one long call: {worst['x_long']:.3f}x at {worst['leaves']} leaves "
                    f"(target <= {SHORT_CALLS_TARGET}x)")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
