"""The demo on the embedded default model: branch, fork, decode together, inspect, prune.

The embedded model has random weights (nothing can be downloaded), so its text is noise; what the
demo shows is the mechanics: a fork costs a pointer, siblings decode in one batch, prune frees blocks.
"""
from __future__ import annotations

import time

from . import Engine, SamplingParams
from .testing import demo_checkpoint
from .wording import counted

PROMPT = ("A river blocks the road. The bridge is gone, the water is cold and fast, and the far bank is "
          "steep. Think of three different ways to get across, then pick the safest one. First idea:")


def run_demo(device: str = "cpu", num_branches: int = 3, max_new_tokens: int = 24, checkpoint: str | None = None) -> Engine:
    folder = checkpoint or demo_checkpoint()
    print(f"model folder: {folder}")
    engine = Engine.from_pretrained(folder, device=device, num_blocks=512)
    print(engine)

    root = engine.new_branch("root", PROMPT)
    print(f"\nroot: {len(root)} prompt tokens, {engine.num_free_blocks} free KV blocks")

    start = time.perf_counter()
    kids = engine.fork(root, num_branches)
    fork_us = (time.perf_counter() - start) * 1e6
    print(f"forked {counted(num_branches, 'branch')} in {fork_us:.0f} us; free blocks still {engine.num_free_blocks} "
          f"(a fork copies no KV)")

    start = time.perf_counter()
    outs = engine.generate(kids, max_new_tokens, SamplingParams(temperature=0.8, top_p=0.95, ignore_eos=True))
    seconds = time.perf_counter() - start
    total = sum(len(o) for o in outs)
    print(f"decoded {counted(num_branches, 'branch')} together: {counted(total, 'token')} in {seconds:.2f} s "
          f"({total / seconds:.0f} tok/s, {counted(max_new_tokens, 'batched step')})\n")
    for kid, out in zip(kids, outs):
        print(f"  {kid.name:>8}: {engine.decode(out)!r}")

    snapshot = engine.block_table()
    shared = sum(1 for block in snapshot["blocks"] if block["readers"] > 1)
    print(f"\ntree: {len(engine.tree()['nodes'])} nodes; {len(snapshot['blocks'])} blocks in use, "
          f"{shared} of them read by more than one branch")

    freed = engine.prune(kids[1:])
    print(f"pruned {[k.name for k in kids[1:]]}: freed {counted(freed, 'block')}; {engine.num_free_blocks} free")
    engine.audit()
    print("audit: refcounts, free list and node invariants OK")
    return engine
