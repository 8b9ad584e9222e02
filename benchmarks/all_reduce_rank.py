"""One rank's side of all_reduce.py's measurements: a module of its own, so that the process all_reduce.py spawns
for rank 1 can import it (a spawned process imports its target by module name)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dendrite_nb.distributed.channels import COLLECTIVE_TIMEOUT, HOST, Channels
from dendrite_nb.kernels.peer_sum import BLOCK, WARPS

CALLS = 64   # all-reduces a graph holds: a 32-layer model's decode step
REPEATS = 20


def seconds(run, device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds of run() (after two untimed runs)."""
    times = []
    for attempt in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def graph_of(body, device: torch.device, times: int = CALLS) -> torch.cuda.CUDAGraph:
    """`times` calls of body() captured in one graph (the collectives' warm-up runs first, eagerly)."""
    body()
    torch.cuda.synchronize(device)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    with torch.cuda.stream(side), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(times):
            body()
    torch.cuda.synchronize(device)
    return graph


def _symm_mem_seconds(x: torch.Tensor, group_name: str) -> float:
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buffer, group_name)
    buffer.copy_(x)
    out = torch.empty_like(x)
    graph = graph_of(lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group_name, out), x.device)
    return seconds(graph.replay, x.device) / CALLS


def _nccl_window_seconds(group, x: torch.Tensor, rank: int, world: int) -> dict[str, float]:
    """NCCL's all-reduce on a buffer of NCCL's own memory (ncclMemAlloc) registered as a symmetric window
    (ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC), where NCCL 2.27 and later run their symmetric kernels; per
    all-reduce in a graph, in place on the buffer and after a copy into it (what the engine would add to a step).
    Registering is collective: every rank calls this at the same point."""
    pool = torch.cuda.MemPool(group.mem_allocator)
    with torch.cuda.use_mem_pool(pool):
        window = torch.empty_like(x)
    group.register_mem_pool(pool, symm=True)
    try:
        window.fill_(rank + 1)
        group.allreduce([window]).wait()
        if not torch.equal(window, torch.full_like(window, world * (world + 1) // 2)):
            raise RuntimeError("NCCL's all-reduce on a symmetric window gave a wrong sum")
        found = {}
        graph = graph_of(lambda: group.allreduce([window]).wait(), x.device)
        found["NCCL window, in a graph"] = seconds(graph.replay, x.device) / CALLS
        graph.reset()
        graph = graph_of(lambda: (window.copy_(x), group.allreduce([window]).wait()), x.device)
        found["NCCL window + copy in, in a graph"] = seconds(graph.replay, x.device) / CALLS
        graph.reset()
        return found
    finally:
        torch.cuda.synchronize(x.device)
        group.deregister_mem_pool(pool)
        del window


def measure(rank: int, world: int, port: int, device_name: str, dtype: torch.dtype, shapes: list[tuple[int, int]],
            results, launches: list[tuple[int, int]] = ((BLOCK, WARPS),)) -> None:
    """Rank `rank`'s side of every measurement; rank 0 puts {(rows, variant): seconds or the reason} in results.
    launches: the (block, warps) of the peer-memory kernel to time."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(HOST, port, world, rank == 0, COLLECTIVE_TIMEOUT)
    channels = Channels(store, rank, world, device)
    cuda = device.type == "cuda"
    if cuda:   # torch.distributed's own group for symm_mem, on a prefix of the same store
        dist.init_process_group("nccl", store=dist.PrefixStore("symm_mem", store), rank=rank, world_size=world,
                                device_id=device)
    found = {}
    try:
        for rows, hidden in shapes:
            x = torch.randn(rows, hidden, device=device).to(dtype)
            found[(rows, "NCCL, eager")] = seconds(lambda: channels.device.allreduce([x]).wait(), device)
            if not cuda:
                continue
            graph = graph_of(lambda: channels.device.allreduce([x]).wait(), device)
            found[(rows, "NCCL, in a graph")] = seconds(graph.replay, device) / CALLS
            graph.reset()
            try:
                for variant, value in _nccl_window_seconds(channels.device, x, rank, world).items():
                    found[(rows, variant)] = value
            except (RuntimeError, AttributeError, TypeError) as error:   # a torch or NCCL without windows
                found[(rows, "NCCL window, in a graph")] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            if channels.peer_sum is None:
                found[(rows, "peer memory, in a graph")] = f"off: {channels.peer_memory_off}"
            for block, warps in ([] if channels.peer_sum is None else launches):
                peer = channels.peer_sum   # its kernel at every size, where the engine sends only small ones
                launch = dict(block=block, warps=warps)
                name = "peer memory" + ("" if (block, warps) == (BLOCK, WARPS) else f" ({block} x {warps} warps)")
                # the buffers alternate as a step's attention and MLP all-reduces do (peer_sum's rule)
                found[(rows, f"{name}, eager")] = seconds(
                    lambda: [peer.sum(x, 0, **launch), peer.sum(x, 1, **launch)], device) / 2
                graph = graph_of(lambda: [peer.sum(x, 0, **launch), peer.sum(x, 1, **launch)], device, CALLS // 2)
                found[(rows, f"{name}, in a graph")] = seconds(graph.replay, device) / CALLS
                graph.reset()
                for buffer in (0, 1):   # every launch's sums, with each rank's own values (buffers still alternating)
                    check = torch.arange(rows * hidden, device=device).remainder(97).to(dtype).view(rows, hidden)
                    want = check * world + sum(range(world))
                    check += rank
                    peer.sum(check, buffer, **launch)
                    if not torch.equal(check, want):
                        raise RuntimeError(f"peer memory's all-reduce ({launch}) gave a wrong sum")
            try:
                found[(rows, "symm_mem one-shot")] = _symm_mem_seconds(x, dist.group.WORLD.group_name)
            except (RuntimeError, AttributeError, ImportError) as error:   # a build or machine without it
                found[(rows, "symm_mem one-shot")] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        if rank == 0:
            results.put(found)
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            dist.destroy_process_group()
        channels.shutdown()
