"""What the live views cost a long generation: 2,000 decode steps over 64 branches, with and without
%tree, %blocks and %throughput listening.

Printed per view: the update messages it sent and their bytes, next to the throttle's ceiling
(one per 100 ms of wall time, plus the first and the final state) and next to the peer a naive view
would be (one message per decode step); and the Python time its updates took, next to the decode
time of the same run. The generation itself is timed with and without the views (same seeds, same
tokens), so their total overhead is measured, not estimated.

    python benchmarks/view_updates.py [--branches 64] [--steps 2000] [--shape llama-gqa-untied] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import comm
import torch
from comm.base_comm import BaseComm

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.testing import write_tiny_checkpoint
from dendrite_nb.widgets import BlockTableView, ThroughputView, TreeView
from dendrite_nb.widgets.feed import DEFAULT_INTERVAL_S


class CountingComm(BaseComm):
    """Counts what would go to the front end: messages, JSON bytes and binary buffer bytes."""

    def __init__(self, *args, **kwargs):
        self.messages, self.json_bytes, self.buffer_bytes = 0, 0, 0
        super().__init__(*args, **kwargs)

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        if msg_type == "comm_msg":
            self.messages += 1
            self.json_bytes += len(json.dumps(data, default=str))
            self.buffer_bytes += sum(len(memoryview(b).cast("B")) for b in buffers or [])


def timed_pushes(view) -> list[float]:
    """Wrap the view's update so each one's Python time is recorded."""
    seconds, push = [], view._push

    def timed():
        start = time.perf_counter()
        push()
        seconds.append(time.perf_counter() - start)

    view._feed._flush = timed
    return seconds


def run(checkpoint: str, branches: int, steps: int, with_views: bool):
    engine = Engine.from_pretrained(checkpoint, num_blocks=branches * (steps // 16 + 2) + 64, block_size=16)
    engine.new_branch("doc", "A shared document that every branch reads once.")
    names = [b.name for b in engine.fork("doc", branches)]
    views, pushes = [], []
    if with_views:
        views = [TreeView(engine), BlockTableView(engine), ThroughputView(engine)]
        pushes = [timed_pushes(view) for view in views]
    start = time.perf_counter()
    outputs = engine.generate(names, steps, SamplingParams(temperature=1.0, seed=0, ignore_eos=True))
    wall_s = time.perf_counter() - start
    comms = [view.comm for view in views]
    for view in views:
        view.close()
    return wall_s, outputs, list(zip(views, comms)), pushes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--shape", default="llama-gqa-untied")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    comm.create_comm = lambda *a, **k: CountingComm(*a, **k)
    checkpoint = write_tiny_checkpoint(tempfile.mkdtemp(), args.shape)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{args.branches} branches x {args.steps:,} steps on the tiny {args.shape} checkpoint (CPU, float32)\n")

    run(checkpoint, 4, 8, with_views=True)   # warm up allocators and the plotly source read
    # Alternate the two kinds of run and keep each kind's fastest: run order alone moves CPU times by tens of %.
    bare_s, viewed_s = float("inf"), float("inf")
    for _ in range(args.repeats):
        seconds, bare_out, _, _ = run(checkpoint, args.branches, args.steps, with_views=False)
        bare_s = min(bare_s, seconds)
        last_viewed_s, viewed_out, views, pushes = run(checkpoint, args.branches, args.steps, with_views=True)
        viewed_s = min(viewed_s, last_viewed_s)
        assert viewed_out == bare_out, "the views changed the generated tokens"

    ceiling = int(last_viewed_s / DEFAULT_INTERVAL_S) + 2   # the counts below are from the last viewed run
    print(f"generation without views: {bare_s:6.2f} s ({args.branches * args.steps / bare_s:,.0f} tok/s)")
    print(f"generation with 3 views : {viewed_s:6.2f} s ({args.branches * args.steps / viewed_s:,.0f} tok/s), "
          f"same tokens; overhead {100 * (viewed_s / bare_s - 1):+.1f}%\n")
    print(f"{'view':<15} {'messages':>8} {'ceiling':>8} {'naive':>6} {'JSON KiB':>9} {'buffers KiB':>12} "
          f"{'update ms (mean/max)':>21} {'share of decode':>16}")
    for (view, sent), seconds in zip(views, pushes):
        share = sum(seconds) / last_viewed_s
        print(f"{type(view).__name__:<15} {sent.messages:>8,} {ceiling:>8,} {args.steps:>6,} "
              f"{sent.json_bytes / 1024:>9,.1f} {sent.buffer_bytes / 1024:>12,.1f} "
              f"{1e3 * sum(seconds) / max(1, len(seconds)):>10.2f} / {1e3 * max(seconds, default=0):>7.2f} "
              f"{100 * share:>15.1f}%")
    print(f"\nceiling: one update per {1e3 * DEFAULT_INTERVAL_S:.0f} ms of wall time plus the first and the final; "
          f"naive: one update per decode step")


if __name__ == "__main__":
    main()
