"""The process groups of one tensor-parallel engine and the few collectives it runs over them.

Three groups, built on one TCPStore (rank 0's, on a port the OS picked) under their own prefixes, as process group
objects of this engine alone: none is torch.distributed's default group, so a second engine in the same kernel, or
an init cell run again, never meets "default process group initialized twice", and closing one engine touches no
other.

    control  gloo: rank 0's commands to the workers, pickled (workers wait here between calls)
    host     gloo: CPU tensors a command moves (KV blocks exported or imported)
    device   the forward's all-reduces: NCCL on CUDA; on the CPU, the host group itself

On GPUs, with DENDRITE_PEER_MEMORY=1 (peer_memory.OPT_IN; off by default, peer_memory.py says why), the small
all-reduces of a forward that a CUDA graph captures (up to 16 KiB: a decode step of one or two rows at hidden 4096
in bf16) skip NCCL: a kernel of this package (kernels/peer_sum.py) sums them through memory every rank maps, in
about 60% of NCCL's time (2 x H200, [1, 4096]: 4.1 against 7.1 us). The ranks agree on that when the channels are
built: all use peer memory or none does.

NCCL runs with NCCL_GRAPH_MIXING_SUPPORT=0 (unless the user set it): that halves what an all-reduce costs inside a
CUDA graph (2 x H200, [64, 4096] bf16: 19.5 -> 10.2 us; a TP=2 8B step of 64 leaves 4.76 -> 4.38 ms, 0.88x ->
0.82x TP=1's). NCCL then asks that no collective be launched outside a graph while a graph with this communicator's
collectives may still run, whatever the streams (its user guide, "NCCL_GRAPH_MIXING_SUPPORT"). So every rank
reports each graph it launches (graph_launched), and the next collective launched outside a graph first waits for
that graph to finish.

Every collective has a timeout (COLLECTIVE_TIMEOUT), so a worker that hangs becomes an error, not a hang; one that
dies closes its connections, which fails the next collective at once. Only a worker waiting for its next command
waits longer (IDLE_TIMEOUT): a notebook may sit idle for days between calls.
"""
from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import peer_memory

HOST = "127.0.0.1"  # one host: every rank is a process of this machine, so they talk over the loopback
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)
ABORT_WAIT_S = 5.0   # an NCCL abort's wait before it is left to finish in the background
# Within gloo's millisecond timer; a worker idle this long exits, and the engine's next call says so.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def _broadcast_options(timeout: datetime.timedelta | None = None) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:
        options.timeout = timeout
    return options


def _gloo(store: dist.Store, name: str, rank: int, world: int) -> Any:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = COLLECTIVE_TIMEOUT
    # Gloo's default device binds to whatever the machine's hostname resolves to, which in some containers is no
    # interface at all.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, options)


def _nccl(store: dist.Store, rank: int, world: int) -> Any:
    # NCCL's watchdog, on a collective past its timeout, by default aborts the communicator and then ends the
    # process: rank 0 is the notebook's kernel. Clean-up only (2) aborts the communicator, and the engine's next
    # call reports the failure. Read when the group is built; a user's own setting is kept.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    # Without graph mixing support NCCL adds no ordering of its own around each collective a graph captured,
    # which cost about 8 us an all-reduce (the module's docstring); Channels keeps the rule that makes it safe.
    # NCCL reads it once per process, at its first communicator.
    os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
    # NCCL's RAS (its health monitor, since 2.24) starts a thread per process at the first communicator, which
    # listens on two ports (localhost:28028, and one on the bootstrap interface) for the rest of the process's life:
    # a notebook that closed its last engine would keep them (the 20-cycle kernel test saw it on 2 x H200).
    os.environ.setdefault("NCCL_RAS_ENABLE", "0")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, world, options)


class Channels:
    """This rank's end of the three groups. Building one waits until every rank builds its own (COLLECTIVE_TIMEOUT
    at most): call it once every rank is known to be up. wait_for: how this rank waits for a CUDA event (rank 0's
    TensorGroup.wait_for watches the workers meanwhile); by default a wait of COLLECTIVE_TIMEOUT at most."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device,
                 wait_for: Callable[[torch.cuda.Event], None] | None = None):
        self.rank, self.world = rank, world
        self._wait_for = wait_for or _wait_for_event
        self._graph_done: torch.cuda.Event | None = None   # recorded after the last graph launched, until waited for
        self.control = _gloo(store, "control", rank, world)
        self.host = _gloo(store, "host", rank, world)
        self.device = _nccl(store, rank, world) if device.type == "cuda" else self.host
        self.peer_sum: peer_memory.PeerSum | None = None
        self.peer_memory_off = _agree_on_peer_memory(store, rank, world, device)   # why not, or None
        if self.peer_memory_off is None:
            self.peer_sum, self.peer_memory_off = _build_peer_memory(store, rank, world, device,
                                                                     {"cpu": self.host, "cuda": self.device})

    @property
    def all_reduce_route(self) -> str:
        """How the forward's all-reduces travel, in words (what %dendrite status shows)."""
        if self.device is self.host:
            return "gloo"
        if self.peer_sum is not None:
            return (f"peer memory up to {peer_memory.FASTER_THAN_NCCL_BYTES // 1024} KiB in CUDA graphs, NCCL "
                    f"otherwise")
        return f"NCCL (peer memory off: {self.peer_memory_off})"

    # ---- commands: rank 0 sends, the workers receive ---------------------------------------------
    def send(self, message: Any) -> None:
        """Rank 0: one pickled message to every worker (its size, then its bytes)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.control.broadcast([torch.tensor([payload.numel()])], _broadcast_options()).wait()
        self.control.broadcast([payload], _broadcast_options()).wait()

    def receive(self) -> Any:
        """A worker: the next message rank 0 sends (waiting up to IDLE_TIMEOUT for it to begin)."""
        size = torch.zeros(1, dtype=torch.long)
        self.control.broadcast([size], _broadcast_options(IDLE_TIMEOUT)).wait()
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.control.broadcast([payload], _broadcast_options()).wait()
        return pickle.loads(payload.numpy().tobytes())

    # ---- tensors ------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, buffer: int = 0) -> None:
        """Sum `tensor` over the ranks, in place (the forward's partial products). buffer: 0 or 1, never the same
        in two calls in a row (the attention's all-reduces take 0, the MLP's 1), for peer memory's inboxes."""
        if self.peer_sum is None or not self.peer_sum(tensor, buffer):
            self._after_graphs()
            self.device.allreduce([tensor]).wait()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype), over the device group."""
        self._after_graphs()
        self.device.broadcast([tensor], _broadcast_options()).wait()

    def graph_launched(self) -> None:
        """Right after this rank launched a CUDA graph that holds collectives of the device group: the next
        collective launched outside a graph waits for it (the module's docstring says why)."""
        if self.device is not self.host:
            self._graph_done = torch.cuda.Event()
            self._graph_done.record()

    @property
    def graph_pending(self) -> bool:
        """Whether a collective launched outside a graph now would first wait for a graph (graph_launched)."""
        return self._graph_done is not None

    def _after_graphs(self) -> None:
        """Before an NCCL collective: outside a capture, wait for the graphs launched before it to finish."""
        if self._graph_done is not None and not torch.cuda.is_current_stream_capturing():
            self._wait_for(self._graph_done)
            self._graph_done = None

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of every rank's `tensor` (same shape and dtype), over the host group, on
        `tensor`'s device: a load's few vectors (distributed/shard.quantize_shard), not a step's."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        on_host = tensor.detach().to("cpu", copy=True)
        self.host.allreduce([on_host], options).wait()
        return on_host.to(tensor.device)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's CPU `tensor` (same shape and dtype on each), on rank 0 in rank order; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.world)]] if self.rank == 0 else []
        self.host.gather(outputs, [tensor], options).wait()
        return outputs[0] if self.rank == 0 else None

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> None:
        """Rank 0's parts[r] (CPU tensors shaped like `out`) into rank r's `out`; parts None on the workers."""
        options = dist.ScatterOptions()
        options.rootRank = 0
        self.host.scatter([out], [parts] if self.rank == 0 else [], options).wait()

    def end_waits(self) -> None:
        """Make this rank's peer-memory kernels stop waiting for the others (a worker died or hangs, or the engine
        closes): those running now end, and so do those still queued. Before anything that waits for the GPU."""
        if self.peer_sum is not None:
            self.peer_sum.abort()

    def shutdown(self) -> None:
        """Close the groups' connections now (the store's port goes with the store). NCCL's communicator is
        aborted rather than shut down: a shutdown flushes it with its peers, and hangs where one is gone (a worker
        killed, or already exited after close). Peer memory's waiting kernels are told to end first."""
        if self.peer_sum is not None:
            self.peer_sum.close()
        for group in {id(g): g for g in (self.device, self.host, self.control)}.values():
            if isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):   # absent from CPU builds
                _abort_nccl(group)
                continue
            try:
                group.shutdown()
            except RuntimeError:   # a group a dead peer already broke: its connections are closed
                pass


def _wait_for_event(event: torch.cuda.Event) -> None:
    """event.synchronize(), but a RuntimeError after COLLECTIVE_TIMEOUT (a graph stuck on a rank that is gone)."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not event.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"a CUDA graph's collectives did not finish within "
                               f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0)


def _agree_on_peer_memory(store: dist.Store, rank: int, world: int, device: torch.device) -> str | None:
    """None where every rank can use peer memory; otherwise why one cannot (every rank gets the same answer)."""
    if device.type != "cuda":
        return "the ranks are not GPUs"
    first = (device.index or 0) - rank
    devices = [torch.device("cuda", first + other) for other in range(world)]
    store.set(f"peer-memory/{rank}", peer_memory.unavailable_reason(devices, rank) or "")
    reasons = [store.get(f"peer-memory/{other}").decode() for other in range(world)]
    return next((f"rank {other}: {reason}" for other, reason in enumerate(reasons) if reason), None)


def _build_peer_memory(store: dist.Store, rank: int, world: int, device: torch.device,
                       backends: dict[str, Any]) -> tuple[peer_memory.PeerSum | None, str | None]:
    """(this rank's PeerSum, None), or (None, why not) on every rank if any rank failed to build its own."""
    name = _shared_value(store, rank, "peer-memory-name", peer_memory.new_name)
    built, error = None, ""
    try:
        built = peer_memory.PeerSum(store, name, rank, world, device, backends)
    except RuntimeError as failure:   # a driver or torch that will not map it: NCCL does every all-reduce
        error = str(failure).strip().splitlines()[0][:300] if str(failure).strip() else type(failure).__name__
    store.set(f"peer-memory-built/{rank}", error)
    errors = [store.get(f"peer-memory-built/{other}").decode() for other in range(world)]
    failed = next((f"rank {other} could not map it: {error}" for other, error in enumerate(errors) if error), None)
    if failed is not None and built is not None:
        built.close()
        built = None
    return built, failed


def _shared_value(store: dist.Store, rank: int, key: str, make) -> str:
    """Rank 0's make() for every rank."""
    if rank == 0:
        store.set(key, make())
    return store.get(key).decode()


def _abort_nccl(group: Any) -> None:
    """Abort an NCCL communicator, waiting ABORT_WAIT_S at most. The abort stops the kernels stuck on a dead peer,
    then waits for every CUDA graph that captured this communicator's collectives to be destroyed; one still
    running (stuck) may keep it waiting, and a notebook must not hang on that: the abort then finishes in the
    background, its thread a daemon."""
    def abort() -> None:
        try:
            group.abort()
        except RuntimeError:   # broken by a dead peer already
            pass
    thread = threading.Thread(target=abort, name="dendrite-nccl-abort", daemon=True)
    thread.start()
    thread.join(ABORT_WAIT_S)
