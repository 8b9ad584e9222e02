"""Fan-out over one document: fork n branches, give each an instruction, decode their first tokens.

A 3,500-token document is prefilled once (not timed). For n in (2, 5, 10, 20, 50), timed from the
fork to the moment all first tokens exist:
  fork:       `fork(doc, n)`, `append_many` of a 16-token instruction to each, `generate(kids, 1)`;
  re-prefill: n new branches, each prefilled with document + instruction from scratch in one
              `append_many` batch, then `generate(branches, 1)` (what an engine without shared
              prefixes does);
  HF:         transformers prefilling the n x 3,516 tokens in one batched forward (with its
              DynamicCache, as for decoding on), for n up to 10 where memory allows.
Each figure is the median of --repeats rounds after untimed ones. For the fork path the first two rounds
of each n are the untimed ones: a prefill shape runs eagerly the first time it comes up and is captured as
a CUDA graph the second time (cuda_graphs.py); the first round's time is printed as "first ms". Floors, measured in the same run:
bytes (weights read per forward, the document's KV read once, new KV written) over the copy bandwidth,
or FLOPs over the matmul rate, whichever is larger. SwarmKV reported 52x (re-prefill over fork) with
two branches on a GTX 1080.

With --flat-prefill the instructions are prefilled as if the backend were not tree-aware: each fork's forward
reads the document once more (the comparison for the tree-aware prefill, Capabilities.tree_prefill).

    python benchmarks/fanout.py [--shape qwen3-0.6b|llama-3.1-8b] [--ns 2 5 10 20 50] [--flat-prefill]
                                [--json PATH] [--smoke]
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from bench_common import (Column, Report, build_model, engine_variant, fits_in_memory, free_memory, hf_twin, log,
                          measure_floors, model_costs, parser, random_ids, setup as make_setup, time_calls)
from dendrite_nb import SamplingParams
from dendrite_nb.testing import REAL_SHAPES

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SWARMKV = "SwarmKV reported 52x with two branches on a GTX 1080"


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--shape", choices=sorted(REAL_SHAPES), default="qwen3-0.6b")
    arguments.add_argument("--ns", type=int, nargs="+", default=None, help="branch counts (default 2 5 10 20 50)")
    arguments.add_argument("--document", type=int, default=None, help="document tokens (default 3500; smoke 96)")
    arguments.add_argument("--instruction", type=int, default=16, help="instruction tokens per branch")
    arguments.add_argument("--repeats", type=int, default=None, help="default 3 (smoke 1)")
    arguments.add_argument("--hf-max-n", type=int, default=10, help="largest n for the transformers peer")
    arguments.add_argument("--attention", default="auto")
    arguments.add_argument("--flat-prefill", action="store_true",
                           help="prefill the forks' instructions flat, the document read once per fork")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    ns = args.ns or ([2, 5] if setup.smoke else [2, 5, 10, 20, 50])
    doc_len = args.document or (96 if setup.smoke else 3500)
    instr_len = args.instruction
    repeats = args.repeats or (1 if setup.smoke else 3)
    report = Report("fanout", setup)
    report.floors = floors = measure_floors(setup)
    hf_config = setup.hf_config(args.shape)
    model = build_model(setup, hf_config)
    costs = model_costs(model, setup.dtype)
    full = doc_len + instr_len
    # The document, n forks (a mid-block start copies the tail block) and n full re-prefilled branches.
    per_branch = -(-(instr_len + 1) // BLOCK_SIZE) + 2 + -(-(full + 1) // BLOCK_SIZE)
    warm_n = next(n for n in range(3, 10**6) if n not in ns)  # compiles the decode kernels, shapes of its own
    num_blocks = -(-doc_len // BLOCK_SIZE) + max(max(ns), warm_n) * per_branch
    engine, reason = engine_variant(model, setup, args.attention, None, block_size=BLOCK_SIZE,
                                    num_blocks=num_blocks + 16)
    if engine is None:
        raise SystemExit(f"attention {args.attention!r} cannot run here: {reason}")
    if args.flat_prefill:
        engine.backend.capabilities = dataclasses.replace(engine.backend.capabilities, tree_prefill=False)
    vocab = model.config.vocab_size
    doc_ids = random_ids(doc_len, vocab, seed=1)
    instructions = random_ids(instr_len, vocab, seed=2, rows=max(ns))
    doc = engine.new_branch("doc", doc_ids)
    log(f"{setup.shape_name(args.shape)}: {engine.config.describe()}, attention {engine.backend.name}; "
        f"{doc_len:,}-token document, {instr_len}-token instructions, "
        f"{'tree-aware' if engine.backend.capabilities.tree_prefill else 'flat'} prefill of the instructions")

    def fork_path(n: int) -> None:
        kids = engine.fork(doc, n)
        engine.append_many(zip(kids, instructions))
        engine.generate(kids, 1, GREEDY)
        engine.prune(kids)   # after the first tokens exist: its cost (tiny) is inside the timing, as in a loop

    def reprefill_path(n: int) -> None:
        branches = [engine.new_branch(f"re{i}") for i in range(n)]
        engine.append_many((b, doc_ids + instructions[i]) for i, b in enumerate(branches))
        engine.generate(branches, 1, GREEDY)
        engine.prune(branches)

    twin = None
    table = report.table(f"fork vs re-prefill: time to all first tokens, {setup.shape_name(args.shape)}, "
                         f"{doc_len:,}-token document",
                         [Column("n", "n", label=True), Column("fork_first_ms", "first ms", "{:.2f}"),
                          Column("fork_ms", "fork ms", "{:.2f}"),
                          Column("fork_floor_ms", "floor", "{:.2f}"), Column("reprefill_ms", "re-prefill ms", "{:.1f}"),
                          Column("reprefill_floor_ms", "floor", "{:.1f}"), Column("hf_ms", "HF ms", "{:.1f}"),
                          Column("ratio", "re-prefill / fork", "{:.1f}x"), Column("hf_ratio", "HF / fork", "{:.1f}x")])
    reprefill_path(min(ns))   # untimed: the prefill shapes' compiles
    fork_path(warm_n)  # untimed: the decode kernels' compiles
    for n in ns:
        first_ms = time_calls(lambda: fork_path(n), setup.device, 1)[0] * 1e3  # this shape's prefill: eager
        fork_ms = statistics.median(time_calls(lambda: fork_path(n), setup.device, repeats, warmup=1)) * 1e3
        reprefill_ms = statistics.median(time_calls(lambda: reprefill_path(n), setup.device, repeats)) * 1e3
        # fork: two forwards (the instructions, then the first tokens), each reading the weights and the document once.
        fork_floor = floors.seconds(2 * costs.weight_bytes + costs.kv_bytes(2 * doc_len + 2 * n * (instr_len + 1)),
                                    n * (costs.prefill_flops(instr_len, doc_len) + costs.prefill_flops(1, full, 0)))
        reprefill_floor = floors.seconds(2 * costs.weight_bytes + costs.kv_bytes(2 * n * (full + 1)),
                                         n * (costs.prefill_flops(full, 0) + costs.prefill_flops(1, full, 0)))
        row = table.add(n=n, fork_first_ms=first_ms, fork_ms=fork_ms, fork_floor_ms=fork_floor * 1e3, reprefill_ms=reprefill_ms,
                        reprefill_floor_ms=reprefill_floor * 1e3, ratio=reprefill_ms / fork_ms)
        if n <= args.hf_max_n:
            hf_bytes = costs.kv_bytes(n * full) + 4 * n * full * model.config.intermediate_size * 2
            if fits_in_memory(setup, hf_bytes):
                if twin is None:
                    twin = hf_twin(model, hf_config, setup)
                ids = torch.tensor([doc_ids + instructions[i] for i in range(n)], device=setup.device)

                def hf_prefill():
                    with torch.inference_mode():
                        twin(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)

                row["hf_ms"] = statistics.median(time_calls(hf_prefill, setup.device, repeats, warmup=1)) * 1e3
                row["hf_ratio"] = row["hf_ms"] / fork_ms
                free_memory(setup.device)
            else:
                row["hf_skipped"] = f"needs about {hf_bytes / 2**30:.1f} GiB"
        log(f"  n={n:>3}: fork {fork_ms:8.2f} ms (first {first_ms:.2f}; floor {fork_floor * 1e3:.2f}), re-prefill {reprefill_ms:9.1f} ms "
            f"(floor {reprefill_floor * 1e3:.1f}), ratio {reprefill_ms / fork_ms:.1f}x"
            + (f", HF {row['hf_ms']:.1f} ms" if "hf_ms" in row else ""))
    engine.audit()
    first = table.rows[0]
    report.note(f"n={first['n']}: re-prefill / fork = {first['ratio']:.1f}x ({SWARMKV}); HF columns for n <= "
                f"{args.hf_max_n} (transformers, one batched forward of n x {full:,} tokens)")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
