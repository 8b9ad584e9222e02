"""1,000 forks off a 2,048-token branch: the fork, the first decode step of all 1,000 leaves, and the blocks used.

  1. `engine.fork(branch, 1000)`: bookkeeping only, 0 KV bytes move (target < 1 ms; GC off while timed). It is
     timed right after a decode step of the previous 1,000 leaves, as a search forks after it generates;
     forks back to back (no step between, so the host's caches stay warm) are shown beside it.
  2. The first decode step of the 1,000 leaves, `generate(kids, 1)`, against its floor: the weights, the
     2,048-token prefix read once and the 1,000 new tokens' KV over the copy bandwidth, or the step's FLOPs
     over the matmul rate if larger (at 1,000 rows the FLOPs usually are).
  3. Each leaf writes 16 tokens in all (`generate(kids, 15)` after the first); then the blocks in use must
     be exactly the prefix's 128 (2,048 / block size 16) + 1,000, one per leaf: PASS or FAIL.
Fork and first step are repeated --repeats times (fork, step, prune) and the medians reported, after one
untimed round that takes the JIT compiles and graph captures for this batch.

Peers in the same run: the same step with flat attention (FlashInfer, every leaf reading the whole
prefix) where it runs; and the copy a transformers user makes per fork (`copy.deepcopy` of the branch's
DynamicCache), measured once and multiplied by 1,000, with the memory those copies would take.

    python benchmarks/fork_decode.py [--shape qwen3-0.6b|llama-3.1-8b] [--forks 1000] [--json PATH] [--smoke]
"""
from __future__ import annotations

import copy
import functools
import gc
import statistics
import time

import torch

from bench_common import (Column, Report, build_model, engine_variant, free_memory, hf_twin, log, measure_floors,
                          model_costs, parser, random_ids, setup as make_setup, sync, time_calls)
from dendrite_nb import SamplingParams
from dendrite_nb.testing import REAL_SHAPES

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
FORK_TARGET_MS = 1.0


def fork_and_first_step(engine, root, forks: int, repeats: int):
    """(fork seconds, first-step seconds) per repeat; the last repeat's leaves are kept and returned."""
    fork_s, step_s, kids = [], [], None
    for repeat in range(repeats + 1):   # round 0 is untimed: compiles and graph captures for this batch
        if kids is not None:
            engine.prune(kids)
            # Dropped here, the pruned leaves' handles free their objects (generators, nodes) now. Left to the
            # assignment below, that teardown ran inside the timed fork: 0.67-0.71 ms a fork on the CI CPU
            # against 0.35 ms (docs/lab/gpu-many-branches.md).
            kids = None
        sync(engine.device)
        gc.disable()
        started = time.perf_counter()
        kids = engine.fork(root, forks)
        forked = time.perf_counter()
        gc.enable()
        engine.generate(kids, 1, GREEDY)
        sync(engine.device)
        stepped = time.perf_counter()
        if repeat:
            fork_s.append(forked - started)
            step_s.append(stepped - forked)
    return fork_s, step_s, kids


def back_to_back_fork_seconds(engine, root, forks: int, repeats: int) -> list[float]:
    """Seconds per fork when forks follow one another (fork, prune, fork, ...) with no decode step between.
    The fork above follows a step of all the leaves, which leaves the host's caches cold: this separates
    the bookkeeping itself from that."""
    seconds = []
    for _ in range(repeats + 1):   # the first is untimed
        gc.disable()
        started = time.perf_counter()
        kids = engine.fork(root, forks)
        seconds.append(time.perf_counter() - started)
        gc.enable()
        engine.prune(kids)
        del kids   # freed here, not inside the next timed fork
    return seconds[1:]


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--shape", choices=sorted(REAL_SHAPES), default="qwen3-0.6b")
    arguments.add_argument("--forks", type=int, default=None, help="default 1000 (smoke 20)")
    arguments.add_argument("--prefix", type=int, default=None, help="tokens of the forked branch (default 2048; "
                                                                     "smoke 64)")
    arguments.add_argument("--own", type=int, default=16, help="tokens each leaf writes in all")
    arguments.add_argument("--repeats", type=int, default=None, help="default 5 (smoke 2)")
    arguments.add_argument("--attention", default="auto")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    forks = args.forks or (20 if setup.smoke else 1000)
    prefix = args.prefix or (64 if setup.smoke else 2048)
    repeats = args.repeats or (2 if setup.smoke else 5)
    report = Report("fork_decode", setup)
    report.floors = floors = measure_floors(setup)
    hf_config = setup.hf_config(args.shape)
    model = build_model(setup, hf_config)
    costs = model_costs(model, setup.dtype)
    prefix_blocks = -(-prefix // BLOCK_SIZE)
    own_blocks = -(-(prefix + args.own) // BLOCK_SIZE) - prefix // BLOCK_SIZE   # a mid-block start copies the tail
    num_blocks = prefix_blocks + forks * (own_blocks + 1) + 16
    engine, reason = engine_variant(model, setup, args.attention, None, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    if engine is None:
        raise SystemExit(f"attention {args.attention!r} cannot run here: {reason}")
    log(f"{setup.shape_name(args.shape)}: {engine.config.describe()}, attention {engine.backend.name}; "
        f"{forks:,} forks off a {prefix:,}-token branch")
    prefix_ids = random_ids(prefix, model.config.vocab_size, seed=1)
    root = engine.new_branch("doc", prefix_ids)
    # Back to back first: later, the kept leaves hold these same names, and a fork would number past them.
    warm_fork_s = back_to_back_fork_seconds(engine, root, forks, 4 * repeats)
    fork_s, step_s, kids = fork_and_first_step(engine, root, forks, repeats)
    fork_ms, step_ms = statistics.median(fork_s) * 1e3, statistics.median(step_s) * 1e3
    step_floor_ms = floors.seconds(costs.weight_bytes + costs.kv_bytes(prefix + forks),
                                   forks * costs.prefill_flops(1, prefix)) * 1e3
    bytes_floor_ms = (costs.weight_bytes + costs.kv_bytes(prefix + forks)) / floors.copy_bytes_per_s * 1e3
    log(f"fork: median {fork_ms:.3f} ms (min {min(fork_s) * 1e3:.3f}); first step: median {step_ms:.2f} ms, floor "
        f"{step_floor_ms:.2f} ms (bytes alone {bytes_floor_ms:.2f} ms)")
    warm_fork_ms = statistics.median(warm_fork_s) * 1e3
    log(f"fork back to back: median {warm_fork_ms:.3f} ms (min {min(warm_fork_s) * 1e3:.3f})")

    rest = args.own - 1
    rest_s = 0.0
    if rest:
        rest_s = time_calls(functools.partial(engine.generate, kids, rest, GREEDY), setup.device, repeats=1)[0]
    in_use = engine.pool.num_blocks - engine.num_free_blocks
    expected_blocks = prefix_blocks + forks * own_blocks
    blocks_ok = in_use == expected_blocks
    engine.audit()
    log(f"{rest} more steps: {rest_s * 1e3:.1f} ms; blocks in use {in_use:,}, expected {expected_blocks:,}")
    # Mid-run figures of the later steps: each leaf then also reads its own tokens.
    rest_floor_ms = sum(floors.seconds(costs.weight_bytes + costs.kv_bytes(prefix + forks * (s + 2)),
                                       forks * costs.prefill_flops(1, prefix + s + 1)) for s in range(rest)) * 1e3

    peer_name, peer_ms, peer_reason = "flashinfer", None, None
    if engine.backend.name == peer_name:
        peer_reason = "the engine itself runs flashinfer (flat) here"
    del kids, root, engine
    free_memory(setup.device)
    if peer_reason is None:
        peer, peer_reason = engine_variant(model, setup, peer_name, None, block_size=BLOCK_SIZE, num_blocks=num_blocks)
        if peer is not None:
            peer_root = peer.new_branch("doc", prefix_ids)
            _, peer_step_s, _ = fork_and_first_step(peer, peer_root, forks, max(1, repeats // 2))
            peer_ms = statistics.median(peer_step_s) * 1e3
            del peer, peer_root
            free_memory(setup.device)

    # transformers: one deep copy of the branch's DynamicCache per fork, measured once.
    twin = hf_twin(model, hf_config, setup)
    with torch.no_grad():
        cache = twin(input_ids=torch.tensor([prefix_ids], device=setup.device), use_cache=True,
                     logits_to_keep=1).past_key_values
        copy_s = statistics.median(time_calls(functools.partial(copy.deepcopy, cache), setup.device, repeats=3,
                                              warmup=1))
    cache_bytes = costs.kv_bytes(prefix)
    copy_floor_ms = 2 * cache_bytes / floors.copy_bytes_per_s * 1e3   # read it and write it
    total_memory = torch.cuda.get_device_properties(setup.device).total_memory if setup.device.type == "cuda" else None
    fits = total_memory is None or forks * cache_bytes < total_memory
    del twin, cache
    free_memory(setup.device)

    table = report.table(f"{forks:,} forks off a {prefix:,}-token branch, {setup.shape_name(args.shape)}",
                         [Column("what", "what", label=True), Column("ms", "ms", "{:.3f}"),
                          Column("floor_ms", "floor ms", "{:.3f}"), Column("x_floor", "x floor", "{:.2f}"),
                          Column("check", "check / target", label=True)])
    table.add(what=f"fork x{forks:,} (one call)", ms=fork_ms, floor_ms=0.0, min_ms=min(fork_s) * 1e3,
              check=f"< {FORK_TARGET_MS:g} ms: {'met' if fork_ms < FORK_TARGET_MS else 'NOT met'} (0 KV bytes)")
    table.add(what=f"  fork x{forks:,}, back to back", ms=warm_fork_ms, floor_ms=0.0, min_ms=min(warm_fork_s) * 1e3,
              check="no step between forks: the bookkeeping alone")
    table.add(what=f"first step, {forks:,} leaves", ms=step_ms, floor_ms=step_floor_ms, x_floor=step_ms / step_floor_ms,
              check=f"bytes floor {bytes_floor_ms:.3f} ms")
    if peer_ms is not None:
        table.add(what="  peer: same step, flashinfer flat", ms=peer_ms, floor_ms=step_floor_ms,
                  x_floor=peer_ms / step_floor_ms, check=f"engine {peer_ms / step_ms:.2f}x faster")
    else:
        table.add(what="  peer: same step, flashinfer flat", check="", unavailable=peer_reason)
    table.add(what="  peer: HF deepcopy per fork x{:,}".format(forks), ms=copy_s * forks * 1e3,
              floor_ms=copy_floor_ms * forks, x_floor=copy_s * 1e3 / copy_floor_ms,
              check=f"{forks * cache_bytes / 1e9:,.1f} GB of copies{'' if fits else ', more than the GPU holds'}",
              one_copy_ms=copy_s * 1e3)
    if rest:
        table.add(what=f"{rest} more steps (per step)", ms=rest_s * 1e3 / rest, floor_ms=rest_floor_ms / rest,
                  x_floor=rest_s * 1e3 / rest_floor_ms, check="")
    table.add(what="blocks in use", blocks_in_use=in_use, expected_blocks=expected_blocks,
              check=f"{in_use:,} == {prefix_blocks:,} + {forks:,} x {own_blocks}: {'PASS' if blocks_ok else 'FAIL'}")
    report.note(f"blocks after {forks:,} leaves x {args.own} tokens: {in_use:,} in use, expected "
                f"{expected_blocks:,}: {'PASS' if blocks_ok else 'FAIL'}")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
