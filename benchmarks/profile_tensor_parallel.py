"""Where a tensor-parallel decode step's time goes (issue 43), on GPUs only: tensor_parallel.py's step (B leaves
forked off a P-token prefix, 16 tokens of their own each; Llama-3.1-8B's shape by default, bf16, random weights) at
TP=1 and at each of --degrees.

For each degree, one generate(copies, --steps) call after the warm-up calls runs under torch.profiler on rank 0,
while every worker records its own profile (its entry point is swapped for profiled_serve below). From each rank's
kernels over the call's last --steps graphs (each starts with the token ids' broadcast):
  parts    the time each part of the step (products, all-reduces, attention, ...) adds to the GPU's busy chain per
           step. Kernels overlap under PDL, so each is charged only the time by which it moves the end of the
           busy time (profile_step.py's gpu_kernels); the parts then add up to the busy time. Beside each, its
           floor where it has one: its bytes (the layers' products' weights, the KV, the LM head) over the
           measured copy bandwidth, each rank reading its 1/N share;
  timeline each rank's span, busy and idle GPU time per step, and the longest idle gaps by the kernels around them.
The step time comes from calls without the profiler (tensor_parallel.py's step_seconds).

    python benchmarks/profile_tensor_parallel.py [--shape llama-3.1-8b] [--leaves 64] [--prefix 4096]
                                                 [--degrees 2] [--steps 8] [--json PATH]
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from bench_common import (Column, Report, busy_chain_us, free_memory, log, measure_floors, model_costs, parser,
                          random_ids)
from bench_common import setup as make_setup
from dendrite_nb import Engine
from dendrite_nb.distributed import worker as worker_module
from dendrite_nb.testing import REAL_SHAPES
from tensor_parallel import BLOCK_SIZE, GREEDY, OWN, leaves_of, step_seconds

# (part, substrings of its kernels' names): the first part whose substring a kernel's name holds takes it.
PARTS = [
    ("products", ("_skinny_kernel", "_gemv_kernel")),
    ("all-reduces", ("AllReduce", "_peer_sum_kernel")),
    ("token broadcast", ("Broadcast",)),
    ("tree attention", ("attention_kernel",)),
    ("merges of partial attention", ("merge_partials",)),
    ("RMSNorm", ("_rms_norm_kernel",)),
    ("RoPE", ("_rope_qk_kernel",)),
    ("KV append", ("_append_kv_kernel",)),
    ("sampling", ("_race_kernel", "_filtered_kernel", "argmax", "Argmax")),
    ("LM head (cuBLAS)", ("gemm", "nvjet", "xmma", "cutlass")),
    ("copies", ("Memcpy", "Memset", "memcpy", "memset")),
]
OTHER = "other"
GAPS_SHOWN = 6
PROFILE_DIR_VARIABLE = "DENDRITE_PROFILE_TP_DIR"   # where every rank writes its trace (inherited by the workers)


def profiled_serve(*args) -> None:
    """A worker's entry point (worker.serve's arguments) that records the worker's whole life under
    torch.profiler and writes rank<r>.json into $DENDRITE_PROFILE_TP_DIR when rank 0 closes the engine."""
    from torch.profiler import ProfilerActivity, profile

    run = worker_module.Worker.run

    def profiled_run(self, store, rank):
        with profile(activities=[ProfilerActivity.CUDA]) as recorded:   # kernels only: a small trace, soon written
            run(self, store, rank)
        recorded.export_chrome_trace(str(Path(os.environ[PROFILE_DIR_VARIABLE]) / f"rank{rank}.json"))
    worker_module.Worker.run = profiled_run
    worker_module.serve(*args)


def part_of(name: str) -> str:
    return next((part for part, needles in PARTS if any(needle in name for needle in needles)), OTHER)


def last_steps(trace: Path, steps: int, whole: bool) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the GPU's kernels and copies in a chrome trace: all of them (whole: rank 0's
    trace holds only the profiled call), or from the start of the steps-th last token broadcast on (a worker's
    trace holds its whole life; each step's graph starts with one broadcast)."""
    if not trace.exists():
        raise RuntimeError(f"no {trace.name}: the worker did not write its trace before close() ended it")
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if whole:
        return kernels
    starts = [index for index, kernel in enumerate(kernels) if "Broadcast" in kernel[2]]
    if len(starts) < steps:
        raise RuntimeError(f"{trace.name}: {len(starts)} token broadcasts, fewer than the {steps} steps profiled")
    return kernels[starts[-steps]:]


def busy_chain(kernels: list[tuple[float, float, str]], steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(ms per step that each part adds to the GPU's busy time, the same for each kernel no part takes): the
    kernels' shares of the busy chain (bench_common.busy_chain_us), summed by part."""
    chain: dict[str, float] = {}
    others: dict[str, float] = {}
    for name, us in busy_chain_us(kernels).items():
        part, ms = part_of(name), us / 1e3 / steps
        chain[part] = chain.get(part, 0.0) + ms
        if part == OTHER:
            others[name[:80]] = others.get(name[:80], 0.0) + ms
    return chain, others


def timeline(kernels: list[tuple[float, float, str]], steps: int) -> tuple[dict[str, float], list[str]]:
    """({span, busy, idle} ms per step, count of gaps per step), and the longest idle gaps summed by the kernels
    around them, as lines."""
    busy = idle = 0.0
    end, previous, gaps, count = kernels[0][0], "", {}, 0
    for start, stop, name in kernels:
        if start > end:
            key = (part_of(previous), part_of(name))
            gaps[key] = gaps.get(key, 0.0) + start - end
            idle += start - end
            count += 1
        busy += max(0.0, stop - max(start, end))
        end, previous = max(end, stop), name
    span = end - kernels[0][0]
    figures = {"span_ms": span / 1e3 / steps, "busy_ms": busy / 1e3 / steps, "idle_ms": idle / 1e3 / steps,
               "gaps": count / steps}
    lines = [f"{us / steps:7.1f} us a step idle after {before} before {after}"
             for (before, after), us in sorted(gaps.items(), key=lambda item: -item[1])[:GAPS_SHOWN]]
    return figures, lines


def profile_call(engine: Engine, leaves: list, steps: int, folder: Path) -> None:
    """One generate call on fresh copies of the leaves under torch.profiler; rank 0's trace into folder."""
    from torch.profiler import ProfilerActivity, profile

    copies = [engine.fork(leaf, 1)[0] for leaf in leaves]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as recorded:
        engine.generate(copies, steps, GREEDY)
        torch.cuda.synchronize()
    recorded.export_chrome_trace(str(folder / "rank0.json"))
    engine.prune(copies)


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--shape", choices=sorted(REAL_SHAPES), default="llama-3.1-8b")
    arguments.add_argument("--leaves", type=int, default=64)
    arguments.add_argument("--prefix", type=int, default=4096, help="prefix tokens")
    arguments.add_argument("--degrees", type=int, nargs="+", default=[2], help="TP=1 always runs first")
    arguments.add_argument("--steps", type=int, default=8, help="steps of the profiled call (and of each timed one)")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("profile_tensor_parallel.py profiles CUDA kernels on every rank: run it on GPUs.")
    degrees = [1] + sorted(set(args.degrees) - {1})
    if max(degrees) > torch.cuda.device_count():
        raise SystemExit(f"--degrees {max(degrees)} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}.")
    report = Report("profile_tensor_parallel", setup)
    report.floors = floors = measure_floors(setup, matmul=False)
    hf_config = setup.hf_config(args.shape)
    vocab = hf_config["vocab_size"]
    prefix_ids = random_ids(args.prefix, vocab, seed=1)
    own_ids = random_ids(OWN, vocab, seed=2, rows=args.leaves)
    blocks = -(-args.prefix // BLOCK_SIZE) + args.leaves * (2 * -(-(OWN + 2 * args.steps) // BLOCK_SIZE) + 2) + 8
    context = args.prefix + args.leaves * (OWN + args.steps / 2)
    chains, steps_ms, timelines, floors_ms = {}, {}, [], {}
    worker_module_serve = worker_module.serve
    os.environ[PROFILE_DIR_VARIABLE] = folder_name = tempfile.mkdtemp(prefix="dendrite-tp-profile-")
    folder = Path(folder_name)
    worker_module.serve = profiled_serve   # the group spawns worker.serve by name: the workers run this one
    try:
        for degree in degrees:
            engine = Engine.from_random(hf_config, device=str(setup.device), dtype=setup.dtype, num_blocks=blocks,
                                        block_size=BLOCK_SIZE, tensor_parallel=degree)
            try:
                if degree == 1:   # the whole model's bytes; a split model's rank 0 holds a shard
                    costs = model_costs(engine.model, engine.kv_dtype)
                    config = engine.model.config
                    head_bytes = config.vocab_size * config.hidden_size * engine.model.lm_head.weight.element_size()
                    layer_bytes = costs.weight_bytes - head_bytes
                leaves = leaves_of(engine, args.leaves, prefix_ids, own_ids)
                steps_ms[degree] = step_seconds(engine, leaves, args.steps, setup.device) * 1e3
                profile_call(engine, leaves, args.steps, folder)
            finally:
                engine.close()   # the workers write their traces as they end
                free_memory(setup.device)
            floors_ms[degree] = {"products": floors.seconds(layer_bytes / degree) * 1e3,
                                 "tree attention": floors.seconds(costs.kv_bytes(context) / degree) * 1e3,
                                 "LM head (cuBLAS)": floors.seconds(head_bytes) * 1e3}
            for rank in range(degree):
                trace = folder / f"rank{rank}.json"
                kernels = last_steps(trace, args.steps, whole=rank == 0)
                if rank == 0:
                    chains[degree], others = busy_chain(kernels, args.steps)
                    for name, ms in sorted(others.items(), key=lambda item: -item[1])[:GAPS_SHOWN]:
                        log(f"TP={degree} rank 0, in no part: {ms:.3f} ms a step {name}")
                figures, lines = timeline(kernels, args.steps)
                timelines.append({"variant": f"TP={degree}", "rank": rank, **figures})
                log(f"TP={degree} rank {rank}: span {figures['span_ms']:.3f} ms a step, busy {figures['busy_ms']:.3f}, "
                    f"idle {figures['idle_ms']:.3f} in {figures['gaps']:.0f} gaps")
                for line in lines:
                    log(f"    {line}")
                trace.unlink()
    finally:
        worker_module.serve = worker_module_serve
        os.environ.pop(PROFILE_DIR_VARIABLE, None)
    columns = [Column("part", "part (rank 0's busy chain, ms a step)", label=True)]
    for degree in degrees:
        columns += [Column(f"tp{degree}_ms", f"TP={degree}", "{:.3f}"), Column(f"tp{degree}_floor", "floor", "{:.3f}")]
    parts = report.table(f"where the step's GPU time goes: {args.leaves} leaves under {args.prefix:,} tokens, "
                         f"{setup.shape_name(args.shape)}", columns)
    widest = chains[degrees[-1]]
    for part in sorted({part for chain in chains.values() for part in chain}, key=lambda part: -widest.get(part, 0)):
        row = {}
        for degree in degrees:
            row[f"tp{degree}_ms"] = chains[degree].get(part, 0.0)
            row[f"tp{degree}_floor"] = floors_ms[degree].get(part)
        parts.add(part=part, **row)
    parts.add(part="busy chain", **{f"tp{degree}_ms": sum(chains[degree].values()) for degree in degrees})
    parts.add(part="step, without the profiler", **{f"tp{degree}_ms": steps_ms[degree] for degree in degrees})
    ranks = report.table("each rank's GPU over the profiled call, ms a step",
                         [Column("variant", "variant", label=True), Column("rank", "rank", label=True),
                          Column("span_ms", "span", "{:.3f}"), Column("busy_ms", "busy", "{:.3f}"),
                          Column("idle_ms", "idle", "{:.3f}"), Column("gaps", "gaps", "{:.0f}")])
    for row in timelines:
        ranks.add(**row)
    for degree in degrees[1:]:
        report.note(f"TP={degree}: {steps_ms[degree] / steps_ms[1]:.2f}x the TP=1 step without the profiler")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
