"""The GPU memory that the ranks of one host read and write in each other's devices, for kernels/peer_sum.py: each
rank's inboxes and flags in one allocation of torch's symmetric memory (torch.distributed._symmetric_memory), which
maps every rank's allocation into every rank's address space (CUDA IPC over NVLink or PCIe peer access).

torch's own one-shot all-reduce over the same memory (symm_mem.one_shot_all_reduce) took 11.7 us where NCCL took
20.2 (docs/lab/tensor-parallel.md; NCCL with graph mixing support, before channels.py turned it off), but its waits
have no way out: a dead peer leaves it spinning on the GPU for good, and with it the notebook's process. peer_sum's
waits end when rank 0 sets this engine's abort word.

The group is this engine's alone: a unique name, registered with torch's symmetric memory together with a prefix of
the engine's own store, so no default process group is made (channels.py says why). NVLink multicast is never
asked for (TORCH_SYMM_MEM_DISABLE_MULTICAST): one-shot sums need only peer loads and stores, and multicast objects
can take a shared host's GPUs out of service.
"""
from __future__ import annotations

import os
import uuid
from typing import Any

import torch
import torch.distributed as dist


CAPACITY_BYTES = 1 << 20  # an inbox slot: a 64-row step at hidden 8192 in bf16 (benchmarks/all_reduce.py)
# The largest all-reduce the engine sends through peer memory (in CUDA graphs: PeerSum.__call__); NCCL takes larger
# ones. On 2 x H100, in CUDA graphs, per all-reduce (docs/lab/tensor-parallel.md, 2026-11-28): [1, 4096] and
# [2, 4096] bf16 4.9 us (NCCL 14.9 and 15.7), [1, 8192] 4.8 and [2, 8192] 5.0 (NCCL 15.8); but [4, 4096], 32 KiB,
# 27.8 (NCCL 16.0), and from there to [16, 4096] 28 to 30 us. (An earlier run gave [16, 4096] 7.6 us: when both
# ranks arrive together, the programs' handshakes seem to run one at a time, and how often they do varies.)
# Those NCCL figures had graph mixing support on; without it (channels.py), on 2 x H200: [1, 4096] 7.1 us against
# peer memory's 4.1, [64, 4096] 10.3 against 38.3 (docs/lab/tensor-parallel.md, 2026-11-28, fifth session).
FASTER_THAN_NCCL_BYTES = 16 << 10
BUFFERS = 2  # inbox sets that take turns (peer_sum.py)
# Peer memory is off unless this environment variable is 1 (on every rank: the workers inherit rank 0's). Why:
# _SymmetricMemory.set_group_info keeps the store it is given for the life of the process, with no way to remove
# it, so the engine's TCP store kept listening on its port after close(), against the engine's promise to leave no
# port behind (test_cycles_of_build_generate_and_close_leave_no_worker_or_port failed so on 2 x H100). A store file
# of its own instead made the second engine of a process hang in its rendezvous (docs/lab/tensor-parallel.md).
# What it buys: all-reduces of up to 16 KiB in CUDA graphs (1 or 2 rows) in about 4-5 us instead of NCCL's 7.
OPT_IN = "DENDRITE_PEER_MEMORY"


def unavailable_reason(devices: list[torch.device], rank: int) -> str | None:
    """Why rank `rank` cannot use peer memory (None: it can): not asked for (OPT_IN), the ranks are not GPUs, this
    torch has no symmetric memory, or this rank's GPU cannot reach another rank's (devices: every rank's, in rank
    order)."""
    if devices[rank].type != "cuda":
        return "the ranks are not GPUs"
    if os.environ.get(OPT_IN) != "1":
        return (f"set {OPT_IN}=1 to use it; off by default, as torch keeps the engine's store, and its port, "
                f"open after close()")
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError as error:
        return f"this torch has no symmetric memory ({error})"
    if not hasattr(_SymmetricMemory, "set_group_info"):
        return "this torch's symmetric memory cannot be given a group of its own"
    mine = devices[rank].index
    unreachable = [str(device) for device in devices if device.index != mine
                   and not torch.cuda.can_device_access_peer(mine, device.index)]
    return f"{devices[rank]} cannot reach the memory of {', '.join(unreachable)}" if unreachable else None


class PeerSum:
    """This rank's end of one engine's peer memory: `__call__(tensor, buffer)` sums a CUDA tensor over the ranks in
    place where that beats NCCL (False, doing nothing, otherwise: the caller then uses NCCL). Built by every rank
    at once (a rendezvous through `store`)."""

    def __init__(self, store: dist.Store, name: str, rank: int, world: int, device: torch.device,
                 backends: dict[str, Any]):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.rank, self.world, self.device, self.name = rank, world, device, name
        self._group = self._memory = None
        self._registered = False
        self._last_buffer: int | None = None   # peer_sum's rule: the buffers alternate
        # Written by the host, read by the kernels' waits: pinned memory that the GPU addresses directly.
        self._abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        try:
            self._build(store, backends)
        except BaseException:
            self.close()
            raise

    def _build(self, store: dist.Store, backends: dict[str, Any]) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        from ..kernels.peer_sum import MAX_PROGRAMS   # here: importing the kernels fixes Triton's interpreter mode

        name, rank, world, device = self.name, self.rank, self.world, self.device
        self.programs = MAX_PROGRAMS
        inbox_bytes = BUFFERS * world * CAPACITY_BYTES
        flag_bytes = BUFFERS * self.programs * world * 4
        # The rendezvous finds its group by name in torch's registry: a process group object of this engine's
        # own (its backends, the channels' gloo and NCCL groups), registered under the unique name, never
        # torch.distributed's default group. set_group_info serves torch versions whose rendezvous reads that.
        group_store = dist.PrefixStore(f"peer-memory/{name}", store)
        self._group = dist.ProcessGroup(group_store, rank, world)
        self._group._set_group_name(name)
        for device_type, backend in backends.items():
            kind = (dist.ProcessGroup.BackendType.NCCL if device_type == "cuda"
                    else dist.ProcessGroup.BackendType.GLOO)
            self._group._register_backend(torch.device(device_type), kind, backend)
        _register_process_group(name, self._group)
        self._registered = True
        _SymmetricMemory.set_group_info(name, rank, world, group_store)
        self._memory = symm_mem.empty(inbox_bytes + flag_bytes, dtype=torch.uint8, device=device)
        self._memory.zero_()   # every flag starts down
        handle = symm_mem.rendezvous(self._memory, name)
        own = self._memory.data_ptr()
        self._byte_deltas = [int(address) - own for address in handle.buffer_ptrs]   # where each rank's lies
        self._inbox_bytes = inbox_bytes
        self._flags = self._memory[inbox_bytes:].view(torch.int32)
        self._flag_deltas = torch.tensor([delta // 4 for delta in self._byte_deltas], dtype=torch.int64,
                                         device=device)
        self._inboxes: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        for dtype in (torch.bfloat16, torch.float16, torch.float32):   # made now: a CUDA graph's capture cannot
            self._inbox(dtype)
        handle.barrier()   # a kernel: no rank's first peer_sum raises a flag in memory a peer has not zeroed yet
        torch.cuda.synchronize(device)

    def __call__(self, tensor: torch.Tensor, buffer: int) -> bool:
        """Sum `tensor` in place if peer memory does it faster than NCCL (True); else do nothing (False): a small
        tensor in a forward that a CUDA graph captures, or in its warm-up, which every rank runs alike and which
        compiles the kernel before the capture. Launched eagerly, the kernel's launch from Python costs more than
        NCCL's whole all-reduce: [1, 4096] bf16 took 59.8 us against NCCL's 33.6, [16, 4096] 65.4 against 40.7
        (2 x H100)."""
        from ..kernels.products import in_graph_forward

        if self._memory is None or not tensor.is_contiguous() or \
                tensor.numel() * tensor.element_size() > FASTER_THAN_NCCL_BYTES or not in_graph_forward():
            return False
        self.sum(tensor, buffer)
        return True

    def sum(self, tensor: torch.Tensor, buffer: int, **launch: int) -> None:
        """Sum a contiguous CUDA tensor of at most CAPACITY_BYTES over the ranks, in place, through peer memory.
        launch: peer_sum's block and warps, for tuning."""
        from ..kernels.peer_sum import peer_sum

        if buffer == self._last_buffer:   # a peer could overwrite the inbox this rank is still summing
            raise ValueError(f"peer memory's all-reduces must alternate their buffers; buffer {buffer} came twice "
                             f"in a row")
        inbox, inbox_deltas = self._inbox(tensor.dtype)
        peer_sum(tensor, self.rank, self.world, inbox, inbox_deltas, self._flags, self._flag_deltas,
                 self._abort.data_ptr(), buffer, **launch)
        self._last_buffer = buffer

    def _inbox(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inbox viewed as `dtype`, and where every rank's lies from it, in elements of `dtype`."""
        if dtype not in self._inboxes:
            size = torch.empty(0, dtype=dtype).element_size()
            self._inboxes[dtype] = (self._memory[:self._inbox_bytes].view(dtype),
                                    torch.tensor([delta // size for delta in self._byte_deltas], dtype=torch.int64,
                                                 device=self.device))
        return self._inboxes[dtype]

    def abort(self) -> None:
        """End every peer_sum of this rank that waits, now and later: the engine is failing or closing."""
        if self._memory is not None:
            self._abort.fill_(1)

    def close(self) -> None:
        from torch._C._distributed_c10d import _unregister_process_group

        self.abort()
        self._memory = self._flags = None
        self._inboxes = {}
        if self._registered:
            _unregister_process_group(self.name)
            self._registered = False
        self._group = None


def new_name() -> str:
    return f"dendrite-peer-{uuid.uuid4().hex}"
