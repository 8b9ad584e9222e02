"""One all-reduce between the ranks of a tensor-parallel engine (issue 43): what each of a decode step's 2 x layers
all-reduces costs, the engine's way and torch's symmetric-memory way.

A [rows, hidden] tensor in --dtype (rows: the leaves of a decode step; hidden 4,096, an 8B model's) summed over two
ranks, one process each (rank 0 this one, rank 1 spawned). Rows, from one run on one machine:
  NCCL, eager            the engine's NCCL group (distributed/channels.py), one all-reduce launched at a time;
  NCCL, in a graph       CALLS all-reduces captured in one CUDA graph and replayed, as a tensor-parallel decode
                         step runs them (cuda_graphs.py);
  NCCL window, in a graph  the same on a buffer of NCCL's own memory registered as a symmetric window, where NCCL
                         (2.27 on) runs its symmetric kernels; "+ copy in": each preceded by a copy into it;
  peer memory, eager     the engine's own one-shot kernel (kernels/peer_sum.py, distributed/peer_memory.py),
                         pushing each rank's tensor into the peer's inbox over NVLink, at every size here (the
                         engine sends it only those up to peer_memory.FASTER_THAN_NCCL_BYTES, and only where
                         DENDRITE_PEER_MEMORY=1, which this script sets); one at a time;
  peer memory, in a graph  the same, CALLS in one graph, the two inbox buffers alternating as in a step;
  symm_mem one-shot      torch's symmetric-memory one-shot all-reduce (each GPU reads its peer's buffer over
                         NVLink: P2P loads, no multicast), captured the same way; torch.distributed's own
                         process group, as the engine's groups are not registered with it.
Floor: each rank reads its peer's tensor once, over the bandwidth of a large copy from the peer's memory (measured
here; on the CPU, the copy bandwidth). On the CPU (--smoke) the group is gloo and only the eager row runs.

    python benchmarks/all_reduce.py [--rows 1 16 64] [--hidden 4096] [--peer-launches 2048x4 8192x8] [--json PATH]
                                    [--smoke]
"""
from __future__ import annotations

import multiprocessing
import os
import socket

import torch

from all_reduce_rank import CALLS, measure, seconds
from bench_common import Column, Floors, Report, log, measure_copy_bandwidth, parser, setup as make_setup
from dendrite_nb.distributed import peer_memory
from dendrite_nb.distributed.channels import HOST
from dendrite_nb.kernels.peer_sum import BLOCK, WARPS


def peer_read_bandwidth(device: torch.device, peer: torch.device) -> float:
    """Bytes/s of one large copy from the peer GPU's memory into this one's (the bytes read)."""
    source = torch.ones(1 << 28, dtype=torch.float32, device=peer)
    target = torch.empty(source.shape, dtype=source.dtype, device=device)
    elapsed = seconds(lambda: target.copy_(source), device, repeats=5)
    return source.numel() * source.element_size() / elapsed


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--rows", type=int, nargs="+", default=None, help="default 1 16 64 (smoke 4)")
    arguments.add_argument("--hidden", type=int, default=None, help="default 4096 (smoke 64)")
    arguments.add_argument("--peer-launches", nargs="+", default=None, metavar="BLOCKxWARPS",
                           help="the peer-memory kernel's launches to time, e.g. 2048x4 8192x8 (default: the "
                                "engine's)")
    args = arguments.parse_args(argv)
    # Peer memory is opt-in (distributed/peer_memory.py says why); this script measures it. The spawned rank
    # inherits the environment.
    os.environ[peer_memory.OPT_IN] = "1"
    launches = [tuple(int(part) for part in text.split("x")) for text in args.peer_launches or []] or \
        [(BLOCK, WARPS)]
    setup = make_setup(args)
    cuda = setup.device.type == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("all_reduce.py needs two GPUs on CUDA (or --device cpu).")
    shapes = [(rows, args.hidden or (64 if setup.smoke else 4096)) for rows in (args.rows or ([4] if setup.smoke
                                                                                                else [1, 16, 64]))]
    report = Report("all_reduce", setup)
    devices = ([torch.device("cuda", (setup.device.index or 0) + r) for r in range(2)] if cuda
               else [setup.device, setup.device])
    read_bytes_per_s = (peer_read_bandwidth(devices[0], devices[1]) if cuda
                        else measure_copy_bandwidth(setup.device, 32 << 20) / 2)
    report.floors = Floors(2 * read_bytes_per_s, None)   # as read + write bytes, the unit Floors counts in
    log(f"reading the peer's memory: {read_bytes_per_s / 1e9:,.0f} GB/s")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with socket.socket() as probe:   # a free port for the ranks' store (rank 0, this process, opens it)
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    peer = context.Process(target=measure, args=(1, 2, port, str(devices[1]), setup.dtype, shapes, results, launches),
                           daemon=True)
    peer.start()
    try:
        measure(0, 2, port, str(devices[0]), setup.dtype, shapes, results, launches)
        found = results.get(timeout=600)
    finally:
        peer.join(60)
        if peer.is_alive():
            peer.kill()
    table = report.table(f"one all-reduce over 2 ranks, {str(setup.dtype).removeprefix('torch.')}",
                         [Column("rows", "rows", "{}", label=True), Column("variant", "variant", label=True),
                          Column("us", "us", "{:.1f}"), Column("floor_us", "floor us", "{:.2f}"),
                          Column("x_floor", "x floor", "{:.1f}"), Column("step_ms", f"x {CALLS} (ms)", "{:.2f}")])
    for (rows, variant), value in found.items():
        if isinstance(value, str):
            table.add(rows=rows, variant=variant, unavailable=value)
            continue
        hidden = next(h for r, h in shapes if r == rows)
        floor = rows * hidden * setup.dtype.itemsize / read_bytes_per_s
        table.add(rows=rows, variant=variant, us=value * 1e6, floor_us=floor * 1e6, x_floor=value / floor,
                  step_ms=value * CALLS * 1e3)
    return report.finish(args.json)


if __name__ == "__main__":
    main()
