"""Sweep the Triton attention's tiling settings over tree_attention.py's scenarios (tree layout, one layer).

Each variant is a TritonAttention built with the given keyword arguments; every variant plans the same
layout and attends with the same q, timed as tree_attention.py times it (CUDA-graph replays, L2 flushed).
FlashInfer is not run here: tree_attention.py measures it beside the defaults.

    python benchmarks/tune_tree_attention.py [--only default "wide 8 warps"] [--launches] [--tensor-parallel N]

--tensor-parallel N sweeps the heads one rank of N holds (the 8B's 32/8 heads become 32/N and 8/N, each of 128
dimensions): one rank's attention at that degree, on one GPU.

--launches also times each launch of a layer alone (one per tile width) and the merge alone, and prints each
launch's items, longest chunk (positions), whether it reads through TMA, and its registers, spilled registers and
shared memory per program: where the whole layer's time goes.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from bench_common import build_model, engine_variant, kernel_seconds, log, parser, setup as make_setup
from dendrite_nb.attention.triton_backend import TritonAttention
from dendrite_nb.kv.cascade import decode_layout
from tree_attention import BLOCK_SIZE, SCENARIOS, Scenario, build_tree

# tree_attention's scenarios; (a): decode_step's 8B layout, 64 leaves x 16 tokens under a 4,096-token prefix;
# (tot): a tree-of-thought step halfway down the search, 5 leaves x 16 tokens under a 576-token path; (1): one
# leaf of 512 tokens, as decode_step's (b) (which has the 0.6B model's heads, half the query heads per KV head).
SWEPT = [*SCENARIOS, Scenario("a", 4096, ((64, 16),), None), Scenario("tot", 576, ((5, 16),), None),
         Scenario("1", 511, ((1, 1),), None)]
# --smoke (a CI check in the CPU interpreter): a shared prefix under leaves with runs of their own, as in (a).
SMOKE_SWEPT = [Scenario("a", 64, ((3, 17),), None)]

VARIANTS = [
    ("default", {}),
    # Block-table loads everywhere (the default before TMA): consecutive runs keep the 128-wide tiles.
    ("no tma", {"tma": False}),
    # Partial outputs in bf16: half the bytes written by every chunk of a shared prefix and read back by the merge.
    ("bf16 partials", {"low_precision_partials": True}),
    ("bf16 partials, programs/SM 3", {"low_precision_partials": True, "programs_per_sm": 3}),
    ("programs/SM 1", {"programs_per_sm": 1}),
    ("programs/SM 3", {"programs_per_sm": 3}),
    ("tiles 32/64/128", {"tile_widths": (32, 64, 128)}),
    ("wide 8 warps", {"wide_launch": (8, 3)}),
    ("wide 4 stages", {"wide_launch": (4, 4)}),
    ("wide block_n 128", {"wide_launch": (8, 2), "wide_block_n": 128}),
    # A 128 x 32 score tile holds half the registers of 128 x 64: fewer spills (36 at 64), twice the steps.
    ("wide block_n 32", {"wide_block_n": 32}),
    ("wide block_n 32, 4 stages", {"wide_block_n": 32, "wide_launch": (4, 4)}),
    ("wide block_n 32, 8 warps", {"wide_block_n": 32, "wide_launch": (8, 3)}),
    ("narrow 3 stages", {"narrow_launch": (4, 3)}),
    ("no short-run launch", {"short_run_launch": (64, 4, 2)}),
    ("short runs 32", {"short_run_launch": (32, 2, 2)}),
    ("merge 4 warps x 16", {"merge_block": (1, 16, 4)}),
    ("merge 2 warps", {"merge_block": (1, 8, 2)}),
    ("merge 4 heads", {"merge_block": (4, 8, 2)}),
    ("merge 4 slots", {"merge_block": (1, 4, 1)}),
    # Narrower widest tiles: more tiles of a many-row segment read each chunk (from L2), but each program holds
    # a smaller accumulator, and fewer, longer chunks fill the GPU (fewer partials to write and merge).
    ("tiles 16/64", {"tile_widths": (64,)}),
    ("tiles 16/64, 1/SM", {"tile_widths": (64,), "programs_per_sm": 1}),
    ("tiles 16/64, 3/SM", {"tile_widths": (64,), "programs_per_sm": 3}),
    ("tiles 16/64, 4 stages", {"tile_widths": (64,), "wide_launch": (4, 4)}),
    ("tiles 16/64, n 128 8w", {"tile_widths": (64,), "wide_launch": (8, 2), "wide_block_n": 128}),
    ("tiles 16/32", {"tile_widths": (32,)}),
    # Longer chunks of a short context: fewer programs, each with more steps, and fewer partials to merge.
    ("min chunk 128", {"min_chunk_tokens": 128}),
    ("min chunk 256", {"min_chunk_tokens": 256}),
]


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--only", nargs="+", default=None, metavar="VARIANT",
                           help="run only these variants (their labels, as printed)")
    arguments.add_argument("--launches", action="store_true",
                           help="also time each launch and the merge alone, with their compiled resources")
    arguments.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                           help="the heads one rank of N holds (default 1: the whole model's)")
    args = arguments.parse_args(argv)
    variants = [(label, options) for label, options in VARIANTS if args.only is None or label in args.only]
    if not variants:
        raise SystemExit(f"no variant is called {args.only}; the variants: {[label for label, _ in VARIANTS]}")
    setup = make_setup(args)
    swept = SMOKE_SWEPT if setup.smoke else SWEPT
    whole = setup.hf_config("llama-3.1-8b")
    if whole["num_key_value_heads"] % args.tensor_parallel:
        raise SystemExit(f"--tensor-parallel {args.tensor_parallel} does not divide the "
                         f"{whole['num_key_value_heads']} KV heads")
    head_dim = whole.get("head_dim") or whole["hidden_size"] // whole["num_attention_heads"]
    hf_config = setup.hf_config("llama-3.1-8b", num_hidden_layers=1, vocab_size=1024, head_dim=head_dim,
                                num_attention_heads=whole["num_attention_heads"] // args.tensor_parallel,
                                num_key_value_heads=whole["num_key_value_heads"] // args.tensor_parallel)
    model = build_model(setup, hf_config)
    config = model.config
    engine, reason = engine_variant(model, setup, "torch", None, block_size=BLOCK_SIZE,
                                    num_blocks=sum(s.num_blocks() for s in swept) + 16)
    if engine is None:
        raise SystemExit(reason)
    kv = engine.pool.layers()[0]
    log(f"one layer, {config.num_heads}q/{config.num_kv_heads}kv heads x{config.head_dim}")
    log(f"{'variant':>20} " + " ".join(f"{'(' + s.key + ') us':>10}" for s in swept))
    layouts = []
    for index, scenario in enumerate(swept):
        leaves = build_tree(engine, scenario, config.vocab_size)
        generator = torch.Generator().manual_seed(index)
        q = torch.randn(len(leaves), config.num_heads, config.head_dim, generator=generator).to(setup.device,
                                                                                               setup.dtype)
        layouts.append((decode_layout(engine.branch_tree, leaves), q))
    for label, options in variants:
        backend = TritonAttention(**options)
        backend.configure(config.num_heads, config.num_kv_heads, kv.k.dtype)
        times, dissections = [], []
        for scenario, (layout, q) in zip(swept, layouts):
            plan = backend.plan(layout, BLOCK_SIZE, setup.device)
            times.append(kernel_seconds(functools.partial(backend.attend, plan, q, kv), setup.device))
            if args.launches:
                dissections.append(f"({scenario.key}) " + launch_by_launch(backend, plan, q, kv, setup.device))
        log(f"{label:>20} " + " ".join(f"{t * 1e6:10.1f}" for t in times))
        for line in dissections:
            log(f"{'':>20}   {line}")


def launch_by_launch(backend: TritonAttention, plan, q: torch.Tensor, kv, device: torch.device) -> str:
    """Each launch of write_partials alone, then the merge alone (us, L2 flushed), with each launch's compiled
    registers / spills / shared memory per program. The layer runs its launches alongside each other (a later
    width waits only before it ends), so the parts add up to more than the layer."""
    parts = []
    for launch in plan.launches:
        alone = dataclasses.replace(plan, launches=[launch])  # same buffers and scratch, one launch
        (compiled,) = backend.write_partials(alone, q, kv)
        seconds = kernel_seconds(functools.partial(backend.write_partials, alone, q, kv), device)
        resources = (f"{compiled.n_regs} regs, {compiled.n_spills} spills, {compiled.metadata.shared / 1024:.0f} KB"
                     if hasattr(compiled, "n_regs") else "interpreted")
        # Whether it read through TMA and its longest chunk: what tells two plans apart.
        tma = plan.reads_through_tma(launch)
        longest = int((launch.items[:, 3] - launch.items[:, 2]).max())
        parts.append(f"{launch.block_m}-wide{' short' if launch.short else ''}{' tma' if tma else ''} "
                     f"x{launch.items.shape[0]} <={longest}: {seconds * 1e6:.1f} us [{resources}]")
    merge = kernel_seconds(functools.partial(backend.merge, plan, q), device)
    return " | ".join(parts) + f" | merge ({plan.num_slots} slots): {merge * 1e6:.1f} us"


if __name__ == "__main__":
    main()
