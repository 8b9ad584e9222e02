"""Attention alone, one layer of 8B-shaped heads (32 q heads, 8 KV heads, head_dim 128): tree-aware vs flat.

Scenarios, every leaf's last token the query over its whole context:
  (i)   256 leaves under an 8,192-token prefix (each leaf 1 token of its own);
  (ii)  a 3-level tree under the 8,192-token prefix: 16 children of 512 tokens each, each with 16
        grandchildren of 64 tokens (256 leaves);
  (iii) 256 leaves under a 256-token prefix (each leaf 1 token of its own).
Methods: triton tree (decode_layout shared=True: each shared node read once per sibling group), triton
flat (shared=False), FlashInfer batch decode (flat) and the torch reference. Each backend gets its own
engine over one shared 1-layer model, built the same way, so every pool holds the same KV; all methods
attend with the same q, and each output is compared with the torch reference (relative error < 1e-2).

Floors, measured in the same run: the bytes that must move (the KV of every distinct token of the tree
once, plus q and the output) over the copy bandwidth, and the FLOPs (4 * heads * head_dim * the
leaves' summed context: q.k and p.v) over the bf16 matmul rate; the floor is the larger. Targets: tree
>= 5x FlashInfer flat on (i) and (ii), and tree >= 0.95x flat on (iii). "host ms" is the per-step host work:
decode_layout plus backend.plan (FlashInfer plans its wrapper inside the first attend, not counted).

    python benchmarks/tree_attention.py [--json PATH] [--smoke]
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from bench_common import (Column, Report, Setup, build_model, engine_variant, free_memory, kernel_seconds, log,
                          measure_floors, parser, random_ids, setup as make_setup)
from dendrite_nb.kv.cascade import decode_layout

BLOCK_SIZE = 16
# (label, backend, tree-aware layout)
METHODS = [("triton tree", "triton", True), ("triton flat", "triton", False),
           ("flashinfer flat", "flashinfer", False), ("torch reference", "torch", False)]
BASELINE = "flashinfer flat"
FALLBACK_BASELINE = "triton flat"
MAX_REL_ERR = 1e-2


@dataclass(frozen=True)
class Scenario:
    key: str
    prefix: int
    levels: tuple[tuple[int, int], ...]  # per level below the prefix: (children per node, tokens of their own)
    target: float | None  # tree speedup over flat that this scenario must reach

    def describe(self) -> str:
        below = " -> ".join(f"x{n} of {own:,} tokens" for n, own in self.levels)
        return f"({self.key}) {self.prefix:,}-token prefix -> {below}"

    def num_blocks(self) -> int:
        blocks, nodes = -(-self.prefix // BLOCK_SIZE), 1
        for children, own in self.levels:
            nodes *= children
            blocks += nodes * (-(-own // BLOCK_SIZE) + 1)
        return blocks


SCENARIOS = [Scenario("i", 8192, ((256, 1),), 5.0),
             Scenario("ii", 8192, ((16, 512), (16, 64)), 5.0),
             Scenario("iii", 256, ((256, 1),), 0.95)]
# Smoke: shared nodes of at least 64 tokens (cascade's MIN_SHARED_TOKENS), so the tree layout has shared segments.
SMOKE_SCENARIOS = [Scenario("i", 128, ((8, 1),), 5.0),
                   Scenario("ii", 128, ((2, 64), (3, 8)), 5.0),
                   Scenario("iii", 64, ((8, 1),), 0.95)]


def build_tree(engine, scenario: Scenario, vocab_size: int) -> list:
    """The scenario's tree in the engine; returns its leaves (branches). Same ids for every engine."""
    frontier = [engine.new_branch(f"s{scenario.key}", random_ids(scenario.prefix, vocab_size, seed=1))]
    for depth, (children, own) in enumerate(scenario.levels):
        frontier = [kid for parent in frontier for kid in engine.fork(parent, children)]
        ids = random_ids(own, vocab_size, seed=10 + depth, rows=len(frontier))
        engine.append_many(zip(frontier, ids))
    return frontier


def distinct_tokens(engine, leaves) -> int:
    """Tokens of every node on the leaves' paths, each node once: the KV a tree-aware read must load."""
    seen, total = set(), 0
    for leaf in leaves:
        node = leaf.node
        while node is not engine.branch_tree.root and node.id not in seen:
            seen.add(node.id)
            total += node.end - node.start
            node = node.parent
    return total


def host_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__).parse_args(argv)
    setup: Setup = make_setup(args)
    report = Report("tree_attention", setup)
    report.floors = floors = measure_floors(setup)
    scenarios = SMOKE_SCENARIOS if setup.smoke else SCENARIOS
    hf_config = setup.hf_config("llama-3.1-8b", num_hidden_layers=1, vocab_size=1024)
    model = build_model(setup, hf_config)
    config = model.config
    elem = torch.finfo(setup.dtype).bits // 8
    kv_bytes_per_token = 2 * config.num_kv_heads * config.head_dim * elem   # one layer, K and V
    num_blocks = sum(s.num_blocks() for s in scenarios) + 16

    # One engine per backend over the shared model; the same calls give each pool the same KV.
    engines, trees, reasons = {}, {}, {}
    for backend in dict.fromkeys(name for _, name, _ in METHODS):
        engine, reason = engine_variant(model, setup, backend, None, block_size=BLOCK_SIZE, num_blocks=num_blocks)
        if engine is None:
            reasons[backend] = reason
            log(f"{backend}: unavailable: {reason}")
            continue
        started = time.perf_counter()
        engines[backend] = engine
        # Each scenario is its own tree of the shapes it names: their prefixes (the same ids) are not shared.
        engine.prefix_reuse = False
        trees[backend] = [build_tree(engine, s, config.vocab_size) for s in scenarios]
        log(f"{backend}: trees built in {time.perf_counter() - started:.1f} s")

    table = report.table("attention, one layer, 32q/8kv heads x128 (CUDA-graph replays, L2 flushed; floor = max(bytes / copy "
                         "bandwidth, FLOPs / matmul rate))" if not setup.smoke else "attention, one layer (smoke)",
                         [Column("scenario", "scenario", label=True), Column("method", "method", label=True),
                          Column("us", "attend us", "{:.1f}"), Column("floor_us", "floor us", "{:.1f}"),
                          Column("x_floor", "x floor", "{:.2f}"), Column("host_ms", "host ms", "{:.2f}"),
                          Column("rel_err", "rel err", "{:.1e}"), Column("speedup", "vs flat", "{:.2f}x")])
    reference = engines["torch"]
    worst_err = 0.0
    for index, scenario in enumerate(scenarios):
        leaves = trees["torch"][index]
        contexts = [len(leaf) for leaf in leaves]
        unique = distinct_tokens(reference, leaves)
        q_bytes = 2 * len(leaves) * config.num_heads * config.head_dim * elem   # q in, out back
        floor_bytes = unique * kv_bytes_per_token + q_bytes
        flops = 4 * config.num_heads * config.head_dim * sum(contexts)
        floor_s = floors.seconds(floor_bytes, flops)
        segments = decode_layout(reference.branch_tree, leaves, shared=True).segments
        shared_segments = sum(len(s.rows) > 1 for s in segments)
        log(f"\n{scenario.describe()}: {len(leaves)} leaves, {sum(contexts):,} context tokens read flat, {unique:,} "
            f"distinct; tree layout: {len(segments):,} segments ({shared_segments} shared); floor "
            f"{floor_s * 1e6:.1f} us (bytes {floor_bytes / floors.copy_bytes_per_s * 1e6:.1f} us, FLOPs "
            f"{flops / floors.matmul_flop_per_s * 1e6:.1f} us)")
        generator = torch.Generator().manual_seed(index)
        q = torch.randn(len(leaves), config.num_heads, config.head_dim, generator=generator).to(setup.device,
                                                                                               setup.dtype)
        ref_layout = decode_layout(reference.branch_tree, leaves, shared=False)
        ref_plan = reference.backend.plan(ref_layout, BLOCK_SIZE, setup.device)
        expected = reference.backend.attend(ref_plan, q, reference.pool.layers()[0]).float()
        rows = {}
        for label, backend, shared in METHODS:
            name = {"scenario": f"({scenario.key})", "method": label}
            if backend not in engines:
                table.add(**name, unavailable=reasons[backend])
                continue
            engine, branches = engines[backend], trees[backend][index]
            kv = engine.pool.layers()[0]
            layout_s = host_seconds(lambda: decode_layout(engine.branch_tree, branches, shared=shared))
            layout = decode_layout(engine.branch_tree, branches, shared=shared)
            plan_s = host_seconds(lambda: engine.backend.plan(layout, BLOCK_SIZE, setup.device))
            plan = engine.backend.plan(layout, BLOCK_SIZE, setup.device)
            try:
                out = engine.backend.attend(plan, q, kv).float()
                rel_err = ((out - expected).norm() / expected.norm()).item()
                # The torch reference allocates tens of GB per call: timed call by call, not captured in a graph.
                seconds = kernel_seconds(functools.partial(engine.backend.attend, plan, q, kv), setup.device,
                                         capture=backend != "torch")
            except torch.OutOfMemoryError as error:  # the torch reference's padded scores on an 80 GB GPU
                del plan
                free_memory(setup.device)
                reason = f"out of GPU memory: {str(error).splitlines()[0][:90]}"
                log(f"  {label:>16}: unavailable: {reason}")
                table.add(**name, unavailable=reason)
                continue
            worst_err = max(worst_err, rel_err)
            rows[label] = table.add(**name, us=seconds * 1e6, floor_us=floor_s * 1e6, x_floor=seconds / floor_s,
                                    host_ms=(layout_s + plan_s) * 1e3, rel_err=rel_err, unique_tokens=unique,
                                    context_tokens=sum(contexts), leaves=len(leaves), segments=len(segments),
                                    shared_segments=shared_segments)
            log(f"  {label:>16}: {seconds * 1e6:9.1f} us ({seconds / floor_s:.2f}x floor), host "
                f"{(layout_s + plan_s) * 1e3:.2f} ms, rel err {rel_err:.1e}")
            del plan, out
        baseline = BASELINE if BASELINE in rows else FALLBACK_BASELINE
        for row in rows.values():
            if baseline in rows:
                row["speedup"] = rows[baseline]["us"] / row["us"]
        if scenario.target is not None and "triton tree" in rows and baseline in rows:
            speedup = rows["triton tree"]["speedup"]
            report.note(f"({scenario.key}) triton tree vs {baseline}: {speedup:.2f}x (target >= {scenario.target:g}x: "
                        f"{'met' if speedup >= scenario.target else 'NOT met'})")
        free_memory(setup.device)
    report.note(f"correctness: largest relative error vs the torch reference {worst_err:.1e} "
                f"({'PASS' if worst_err < MAX_REL_ERR else 'FAIL'}, limit {MAX_REL_ERR:g}); 'vs flat' = "
                f"{BASELINE if 'flashinfer' in engines else FALLBACK_BASELINE} time / this time")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
