"""Where a decode step's time goes, for the cases of decode_step.py: host phases, GPU kernels, idle GPU.

For each case (triton attention, CUDA graphs as the engine defaults them):
  1. step time: a step inside one generate(leaves, --steps) call, and one generate(leaves, 1) call;
  2. host phases: inclusive wall time per step of the engine's functions on the decode path (wrapped with
     timers for one generate call); "wait for GPU" is the time the host blocks reading the sampled tokens;
  3. GPU: torch.profiler kernels over one generate call: device time per step by kernel, busy vs wall;
  4. attention alone: one layer's write_partials and merge, for chunking and tile variants.

    python benchmarks/profile_step.py [--cases a b tot tot8b fork a06b s4 s16 s64] [--steps 16] [--weights fp8] [--smoke]
"""
from __future__ import annotations

import collections
import functools
import statistics
import time

import torch

import dendrite_nb.engine.decode as decode_module
from bench_common import (build_model, busy_chain_us, engine_variant, free_memory, generate_on_copies,
                          kernel_seconds, log, parser, random_ids)
from bench_common import setup as make_setup
from decode_step import CASES, GREEDY, SMOKE_CASES, Case, num_blocks
from dendrite_nb import Engine, SamplingParams
from dendrite_nb.attention.triton_backend import TritonAttention
from dendrite_nb.attention.triton_plan import HostPlan
from dendrite_nb.cuda_graphs import ForwardGraphs
from dendrite_nb.forward import ForwardRunner
from dendrite_nb.kv.cascade import SegmentCache, decode_layout
from dendrite_nb.kv.tree import BranchTree
from dendrite_nb.model.quantized_linear import quantize_model

# (owner, attribute, label): the host functions timed per step.
HOST_PHASES = [
    (decode_module.DecodeLoop, "_schedule", "schedule (masks, LM head launch)"),
    (decode_module.DecodeLoop, "_plan", "plan step (token-free)"),
    (BranchTree, "append", "  tree.append"),
    (BranchTree, "block_table", "  block tables"),
    (SegmentCache, "segments", "  segments"),
    (ForwardGraphs, "prepare", "  graphs.prepare"),
    (TritonAttention, "host_plan", "    host_plan"),
    (HostPlan, "pack", "    pack"),
    (decode_module, "sample", "sample (launch)"),
    (ForwardRunner, "read_back", "read_back"),
    (decode_module.DecodeLoop, "_launch", "launch step (forward)"),
    (ForwardGraphs, "launch", "  graphs.launch"),
    (torch.cuda.CUDAGraph, "replay", "    graph.replay"),
    (Engine, "_emit", "_emit (listeners)"),
]
# Attention variants: (label, TritonAttention keyword arguments).
ATTENTION_VARIANTS = [
    ("default", {}),
    ("programs/SM 4", {"programs_per_sm": 4}),
    ("min chunk 256", {"min_chunk_tokens": 256}),
    ("wide 8 warps", {"wide_launch": (8, 3)}),
    ("wide block_n 128", {"wide_block_n": 128}),
    ("wide 8w, n 128", {"wide_launch": (8, 3), "wide_block_n": 128}),
    ("wide 8w 2 stages", {"wide_launch": (8, 2)}),
    ("narrow 2 warps", {"narrow_launch": (2, 2)}),
    ("narrow 3 stages", {"narrow_launch": (4, 3)}),
    ("merge 8h x 4s", {"merge_block": (8, 4, 4)}),
    ("merge 2h x 16s", {"merge_block": (2, 16, 4)}),
    ("merge 1h x 8s x 2 warps", {"merge_block": (1, 8, 2)}),
]
WAIT = "wait for GPU (tokens)"
# A step of tree_of_thought.py's 0.6B search halfway down: 5 leaves sampled at temperature 0.8 under the
# prompt and five levels of 32 tokens, each with a half-level of its own.
TOT_CASE = Case("tot", "qwen3-0.6b", 256 + 5 * 32, 5, 16, 20.0)
SMOKE_TOT_CASE = Case("tot", "qwen3-0.6b", 32, 5, 4, 20.0)
TOT_8B_CASE = Case("tot8b", "llama-3.1-8b", 256 + 5 * 32, 5, 16, 5.0)  # the same step of the 8B search
SMOKE_TOT_8B_CASE = Case("tot8b", "llama-3.1-8b", 32, 5, 4, 5.0)
TOT_SAMPLING = SamplingParams(temperature=0.8, ignore_eos=True)
# Many leaves of a small model, where the host's per-row bookkeeping may outlast the GPU's step: fork_decode.py's
# 1,000 leaves, and decode (a)'s layout (64 leaves under 4,096 tokens) on the 0.6B shape.
# batch_scaling.py's steps of 4, 16 and 64 leaves off a 512-token prefix (issue 42's target: at most 1.3x one leaf).
EXTRA_CASES = {"fork": Case("fork", "qwen3-0.6b", 2048, 1000, 16, 0.0),
               "a06b": Case("a06b", "qwen3-0.6b", 4096, 64, 16, 0.0),
               **{f"s{n}": Case(f"s{n}", "qwen3-0.6b", 512, n, 16, 0.0) for n in (4, 16, 64)}}
SMOKE_EXTRA_CASES = {"fork": Case("fork", "qwen3-0.6b", 64, 20, 4, 0.0),
                     "a06b": Case("a06b", "qwen3-0.6b", 64, 8, 4, 0.0),
                     **{f"s{n}": Case(f"s{n}", "qwen3-0.6b", 24, n, 4, 0.0) for n in (4, 16, 64)}}


class HostTimers:
    """Wraps HOST_PHASES with inclusive wall-clock timers while active; WAIT is the host blocked on the tokens."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: collections.Counter = collections.Counter()

    def __enter__(self):
        self._saved = []
        for owner, name, label in HOST_PHASES:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original, label))
        return self

    def _timed(self, original, label: str):
        seconds = self.seconds
        reads_back = label == "read_back"   # returns the function that waits for the tokens: time that wait

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = original(*args, **kwargs)
            seconds[label] += time.perf_counter() - started
            if reads_back:
                return self._timed(result, WAIT)
            return result
        return timed

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def gpu_kernels(engine, leaves, steps: int, sampling: SamplingParams,
                device: torch.device) -> tuple[list[tuple[str, float, float, int]], float, float]:
    """(name, device ms per step, ms per step it extends the busy time by, launches per step) by kernel, busy
    ms per step, wall ms per step.

    Under PDL device times overlap and do not add up to the step; the second figure does
    (bench_common.busy_chain_us): the figures sum to the busy time and show the chain a step waits on."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        engine.generate(leaves, steps, sampling)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    kernels = collections.defaultdict(lambda: [0.0, 0.0, 0])
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            name = event.name[:70]
            kernels[name][0] += event.device_time_total
            kernels[name][2] += 1
            spans.append((event.time_range.start, event.time_range.end, name))
    chain = busy_chain_us(spans)
    for name, us in chain.items():
        kernels[name][1] = us
    covered = sum(chain.values())
    rows = sorted(((name, us / 1e3 / steps, chain_us / 1e3 / steps, count // steps)
                   for name, (us, chain_us, count) in kernels.items()), key=lambda row: -row[2])
    return rows, covered / 1e3 / steps, wall * 1e3 / steps


def attention_parts(engine, leaves, device: torch.device) -> None:
    config = engine.model.config
    kv = engine.pool.layers()[0]
    layout = decode_layout(engine.branch_tree, leaves)
    q = torch.randn(len(leaves), config.num_heads, config.head_dim, device=device, dtype=engine.pool.kv.dtype)
    log(f"  {'variant':>16} {'partials us':>11} {'merge us':>8} {'attend us':>9} {'slots':>6} {'items':>14}")
    for label, options in ATTENTION_VARIANTS:
        backend = TritonAttention(**options)
        backend.configure(config.num_heads, config.num_kv_heads, kv.k.dtype)
        plan = backend.plan(layout, engine.pool.block_size, device)
        backend.write_partials(plan, q, kv)
        partials = kernel_seconds(functools.partial(backend.write_partials, plan, q, kv), device)
        merge = kernel_seconds(functools.partial(backend.merge, plan, q), device)
        attend = kernel_seconds(functools.partial(backend.attend, plan, q, kv), device)
        items = "+".join(f"{launch.items.shape[0]}x{launch.block_m}" for launch in plan.launches)
        log(f"  {label:>16} {partials * 1e6:11.1f} {merge * 1e6:8.1f} {attend * 1e6:9.1f} {plan.num_slots:6d} "
            f"{items:>14}")


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--cases", nargs="+", choices=sorted(CASES) + ["tot", "tot8b", *EXTRA_CASES],
                           default=sorted(CASES),
                           help="decode_step.py's cases; tot / tot8b: a step of tree_of_thought.py's 0.6B / 8B "
                                "search; fork: fork_decode.py's 1,000 leaves; a06b: (a)'s layout on the 0.6B shape; "
                                "s4/s16/s64: batch_scaling.py's steps of 4/16/64 leaves")
    arguments.add_argument("--steps", type=int, default=16)
    arguments.add_argument("--weights", choices=["fp8"], default=None, help="quantize the weights first")
    arguments.add_argument("--search-sampler", action="store_true",
                           help="sample every case with batch_scaling.py's search sampler (top-k, top-p, min-p)")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("profile_step.py profiles CUDA kernels and graphs: run it on a GPU.")
    for key in args.cases:
        cases = {**(SMOKE_CASES if setup.smoke else CASES), "tot": SMOKE_TOT_CASE if setup.smoke else TOT_CASE,
                 "tot8b": SMOKE_TOT_8B_CASE if setup.smoke else TOT_8B_CASE,
                 **(SMOKE_EXTRA_CASES if setup.smoke else EXTRA_CASES)}
        case = cases[key]
        sampling = TOT_SAMPLING if key.startswith("tot") else GREEDY
        if args.search_sampler:
            from batch_scaling import search_sampler
            sampling = search_sampler()
        model = build_model(setup, setup.hf_config(case.shape))
        if args.weights:
            quantize_model(model, args.weights)
        vocab = model.config.vocab_size
        engine, reason = engine_variant(model, setup, "triton", None, block_size=16,
                                        num_blocks=num_blocks(case, 8 * args.steps + 16))
        if engine is None:
            raise SystemExit(f"the triton engine cannot run here: {reason}")
        root = engine.new_branch("prefix", random_ids(case.prefix, vocab, seed=1))
        leaves = [root]
        if case.leaves > 1:
            leaves = engine.fork(root, case.leaves)
            engine.append_many(zip(leaves, random_ids(case.own, vocab, seed=2, rows=case.leaves)))
        log(f"\n({key}) {case.shape}, {case.describe()}")
        # Every call runs on fresh copies of the leaves (bench_common.generate_on_copies): the same shapes each
        # time, so what is timed and profiled below replays the graphs the first call captured.
        in_call = generate_on_copies(engine, leaves, args.steps, sampling, setup.device, repeats=3, warmup=1)
        in_call = [seconds / args.steps for seconds in in_call]
        single = generate_on_copies(engine, leaves, 1, sampling, setup.device, repeats=10, warmup=1)
        captures = engine._graphs.captures
        log(f"  step inside generate(leaves, {args.steps}): {statistics.median(in_call) * 1e3:.3f} ms; "
            f"one generate(leaves, 1) call: {statistics.median(single) * 1e3:.3f} ms")

        copies = [engine.fork(leaf, 1)[0] for leaf in leaves]
        with HostTimers(setup.device) as timers:
            torch.cuda.synchronize(setup.device)
            started = time.perf_counter()
            engine.generate(copies, args.steps, sampling)
            wall = time.perf_counter() - started
        engine.prune(copies)
        log(f"  host phases per step (inclusive; wall {wall * 1e3 / args.steps:.3f} ms/step with timers):")
        for _, _, label in HOST_PHASES + [(None, None, WAIT)]:
            log(f"    {label:<32} {timers.seconds[label] * 1e3 / args.steps:8.3f} ms")

        copies = [engine.fork(leaf, 1)[0] for leaf in leaves]
        rows, busy_ms, wall_ms = gpu_kernels(engine, copies, args.steps, sampling, setup.device)
        engine.prune(copies)
        if engine._graphs.captures != captures:
            log(f"  ({engine._graphs.captures - captures} CUDA graph captures inside the timed calls: not steady)")
        log(f"  GPU: busy {busy_ms:.3f} ms of {wall_ms:.3f} ms wall per step (profiled; idle "
            f"{wall_ms - busy_ms:.3f} ms)")
        log(f"    {'device ms':>9} {'chain ms':>8}  launches  kernel   (chain: the busy time it adds; sums to busy)")
        for name, ms, chain_ms, count in rows[:16]:
            log(f"    {ms:9.3f} {chain_ms:8.3f}  x{count:<7} {name}")
        log("  attention alone, one layer:")
        attention_parts(engine, leaves, setup.device)
        del engine, model
        free_memory(setup.device)


if __name__ == "__main__":
    main()
