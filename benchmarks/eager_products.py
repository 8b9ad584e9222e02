"""Eager decode steps (no CUDA graphs): few-row products through cuBLAS, as the engine sends them outside a
capture, against skinny, as a captured step runs them (kernels/products.py), alternating in one process.

An eager step on a GPU is bound by the host's launches, so the comparison is of host costs per launch. The two
dispatches alternate round by round on one machine, because that host's noise moves a single run by up to 2x.
"skinny" runs the same step inside kernels.products.graph_products(), the block that decode graphs capture in.
Graph steps ("graphs" rows) are printed for scale: they always run skinny.

Cases (random weights, bf16): (a) is decode_step.py's 8B case, 64 leaves under a 4,096-token prefix. The others
are 5 or 16 leaves, each with 16 tokens of its own, under a 512-token (0.6B) or 1,024-token (8B) prefix.

    python benchmarks/eager_products.py [--cases a 0.6b-5] [--rounds 2] [--steps 10]
"""
from __future__ import annotations

import contextlib
import statistics

from bench_common import build_model, free_memory, log, parser, random_ids, setup as make_setup
from decode_step import CASES as DECODE_CASES, Case, engine_step_seconds
from dendrite_nb.kernels.products import graph_products

CASES = {"a": DECODE_CASES["a"],
         "0.6b-5": Case("0.6b-5", "qwen3-0.6b", 512, 5, 16, 0.0),
         "0.6b-16": Case("0.6b-16", "qwen3-0.6b", 512, 16, 16, 0.0),
         "8b-5": Case("8b-5", "llama-3.1-8b", 1024, 5, 16, 0.0),
         "8b-16": Case("8b-16", "llama-3.1-8b", 1024, 16, 16, 0.0)}
# (attention, cuda_graphs, products' dispatch): eager steps both ways, then a graph step for scale.
VARIANTS = [("triton", False, "cuBLAS"), ("triton", False, "skinny"), ("flashinfer", False, "cuBLAS"),
            ("flashinfer", False, "skinny"), ("triton", True, "graphs")]


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["a", "0.6b-5"])
    arguments.add_argument("--rounds", type=int, default=2, help="times each variant runs, alternating")
    arguments.add_argument("--steps", type=int, default=10, help="steps per generate call (3 timed calls)")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("eager_products compares launches on a GPU (on the CPU skinny always runs); run it on one.")
    for key in args.cases:
        case = CASES[key]
        model = build_model(setup, setup.hf_config(case.shape))
        vocab = model.config.vocab_size
        prefix_ids = random_ids(case.prefix, vocab, seed=1)
        own_ids = random_ids(case.own, vocab, seed=2, rows=case.leaves)
        log(f"\n({key}) {case.shape}, {case.describe()}: ms a step (median of 3 calls of {args.steps} steps)")
        results: dict[tuple, list[float]] = {}
        for round_index in range(args.rounds):
            for attention, graphs, dispatch in VARIANTS:
                with graph_products() if dispatch == "skinny" else contextlib.nullcontext():
                    measured, reason = engine_step_seconds(model, setup, attention, graphs, case, prefix_ids,
                                                           own_ids, args.steps, warmup=1)
                free_memory(setup.device)
                if measured is None:
                    log(f"  round {round_index} {attention:>10} {dispatch:>6}: unavailable: {reason}")
                    continue
                step_ms = statistics.median(measured[0]) * 1e3
                results.setdefault((attention, dispatch), []).append(step_ms)
                log(f"  round {round_index} {attention:>10} {dispatch:>6}: {step_ms:7.3f} ms "
                    f"(calls {', '.join(f'{t * 1e3:.2f}' for t in measured[0])})")
        for attention in ("triton", "flashinfer"):
            ours, theirs = results.get((attention, "cuBLAS")), results.get((attention, "skinny"))
            if ours and theirs:
                wins = sum(a < b for a, b in zip(ours, theirs))
                log(f"  {attention}: cuBLAS faster in {wins} of {len(ours)} rounds; medians "
                    f"{statistics.median(ours):.3f} against {statistics.median(theirs):.3f} ms")
        del model
        free_memory(setup.device)


if __name__ == "__main__":
    main()
