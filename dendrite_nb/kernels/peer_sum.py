"""The sum of one tensor over the GPUs of a host, in one kernel that writes straight into the peers' memory: a
tensor-parallel decode step's all-reduce of a few rows (distributed/peer_memory.py maps the buffers and decides
which all-reduces come here).

Why not NCCL's all-reduce: inside a CUDA graph NCCL took 17.8 us for [1, 4096] bf16 on 2 x H100, where the bytes
cross NVLink in nanoseconds: at that size an all-reduce is a handshake, not bandwidth. This is the one-shot scheme
of torch's symmetric memory and of vLLM's and TensorRT-LLM's custom all-reduces: every rank pushes its whole
tensor into each peer's inbox (remote stores over NVLink do not wait for an answer, as remote loads do), raises a
flag there, waits for the peers' flags in its own memory, and adds up its inbox, in rank order on every rank, so
that all ranks hold the same sum to the bit. It took 4.8-4.9 us for that tensor and for [2, 4096] (NCCL 15-18);
from [4, 4096] it took 28-39 us in the runs of 2026-11-28, against NCCL's 16-21 (one run of 2026-11-27 gave
[16, 4096] 7.6 us: see MAX_PROGRAMS), so the engine sends it only the smallest (peer_memory.py). Those NCCL
figures had NCCL's graph mixing support on; the engine turns it off (distributed/channels.py), and NCCL then took
7.1 us for [1, 4096] on 2 x H200, where this kernel took 4.1.

Each rank's peer memory: an inbox [2 buffers, world senders, capacity] of the tensor's dtype and flags int32
[2 buffers, programs, world senders]. Program p moves one span of the tensor, BLOCK elements at a time, and raises
and takes flag [buffer, p, rank] alone, so no program waits for the whole tensor. A flag goes 0 -> 1 by its sender
(release, at system scope, after the program's stores), 1 -> 0 by its receiver (acquire), so it is reset without
a second handshake. The two buffers take turns (the attention's all-reduce uses 0, the MLP's 1, and a step
alternates them): a rank writes into a peer's buffer b again only two all-reduces later, and by then it has seen
the peer's flags of the all-reduce between, which the peer raised after its kernel of the last use of b had
ended. So one handshake per all-reduce suffices, where a single buffer needs a second (the peers' "done reading").

A wait never outlasts the engine: it also reads the abort word (in pinned host memory), which rank 0 sets when a
worker dies or hangs, as NCCL's abort stops its kernels; the kernel then ends (its output is garbage, and the
engine is already failing). In the CPU interpreter (CI), the same kernel runs on shared host memory between two
processes: the flags' protocol works there too, as each flag has one writer per direction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_arguments, wait_for_inputs

BLOCK, WARPS = 2048, 4  # elements a program moves at a time (4 KB of bf16), and its warps
# Programs at most. Past about eight, each program added about 4 us to an all-reduce (why is not known; a version
# with a single handshake for the whole kernel scaled the same way, so it is not the per-program remote atomics):
# on 2 x H100, [64, 4096] bf16 in a graph took 542 us in 128 programs, 133 in 32, 67 in 16; [16, 4096] 131 us in
# 32 and 6.5 in 8 (docs/lab/tensor-parallel.md).
MAX_PROGRAMS = 8
ABORT_POLL = tl.constexpr(64)  # spins between two reads of the abort word (a read crosses PCIe: about a microsecond)


@triton.jit
def _cas(flag_ptr, expected, new, RELEASE: tl.constexpr):
    if RELEASE:
        seen = tl.atomic_cas(flag_ptr, expected, new, sem="release", scope="sys")
    else:
        seen = tl.atomic_cas(flag_ptr, expected, new, sem="acquire", scope="sys")
    return seen


@triton.jit
def _flip_when_ready(flag_ptr, expected, new, abort_ptr, RELEASE: tl.constexpr):
    """Flip the flag from `expected` to `new` once it holds `expected` (one thread of the program does the atomic;
    its result is shared with all), unless the abort word is set first. The wait reads the flag plainly and tries
    the atomic only when the read says it would succeed: a hundred programs spinning on system-scope atomics
    would flood the memory system that the peer's stores cross."""
    seen = _cas(flag_ptr, expected, new, RELEASE)
    waiting = seen != expected
    spins = 0
    while waiting:
        if tl.load(flag_ptr, volatile=True) == expected:
            seen = _cas(flag_ptr, expected, new, RELEASE)
            waiting = seen != expected
        spins += 1
        if waiting & (spins % ABORT_POLL == 0):
            waiting = tl.load(abort_ptr, volatile=True) == 0


@triton.jit
def _peer_sum_kernel(x_ptr, inbox_ptr, inbox_deltas_ptr, flags_ptr, flag_deltas_ptr, abort_address, numel, span,
                     capacity, programs, BUFFER: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    # inbox_ptr / flags_ptr: this rank's inbox (x's dtype) and flags (int32). Rank r's are at inbox_ptr +
    # inbox_deltas[r] and flags_ptr + flag_deltas[r] (int64 [WORLD], in elements, as this process maps them):
    # offsets from a kernel argument keep its 16-byte alignment known to the compiler, so the loads and stores
    # are vectorised; addresses cast from integers were not (2-byte stores across NVLink).
    # Program p moves elements [p * span, +span) (span a multiple of BLOCK), BLOCK at a time.
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    abort_ptr = abort_address.to(tl.pointer_type(tl.int32))
    first = pid * span
    last = tl.minimum(first + span, numel)
    wait_for_inputs(PDL)
    # Push: this rank's part into slot [BUFFER, RANK] of every peer's inbox.
    for start in range(first, last, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < last
        x = tl.load(x_ptr + offsets, mask=mask)
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                delta = tl.multiple_of(tl.load(inbox_deltas_ptr + peer), 16)
                tl.store(inbox_ptr + delta + (BUFFER * WORLD + RANK) * capacity + offsets, x, mask=mask)
    tl.debug_barrier()  # every thread's stores precede the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_flags = flags_ptr + tl.load(flag_deltas_ptr + peer)
            _flip_when_ready(peer_flags + (BUFFER * programs + pid) * WORLD + RANK, 0, 1, abort_ptr, True)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _flip_when_ready(flags_ptr + (BUFFER * programs + pid) * WORLD + peer, 1, 0, abort_ptr, False)
    tl.debug_barrier()
    for start in range(first, last, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < last
        total = tl.zeros([BLOCK], tl.float32)
        for sender in tl.static_range(WORLD):   # rank order on every rank: the same sum everywhere
            if sender == RANK:
                total += tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
            else:
                # .cg: from L2, where the peer's stores land, never from a line this SM cached before
                part = tl.load(inbox_ptr + (BUFFER * WORLD + sender) * capacity + offsets, mask=mask,
                               cache_modifier=".cg")
                total += part.to(tl.float32)
        tl.store(x_ptr + offsets, total.to(dtype), mask=mask)


def launch_shape(numel: int, block: int = BLOCK) -> tuple[int, int]:
    """(programs, span): at most MAX_PROGRAMS programs of `span` elements each, a multiple of `block`."""
    programs = max(1, min(MAX_PROGRAMS, triton.cdiv(numel, block)))
    return programs, triton.cdiv(triton.cdiv(numel, programs), block) * block


def peer_sum(x: torch.Tensor, rank: int, world: int, inbox: torch.Tensor, inbox_deltas: torch.Tensor,
             flags: torch.Tensor, flag_deltas: torch.Tensor, abort_address: int, buffer: int, *,
             block: int = BLOCK, warps: int = WARPS) -> None:
    """Sum x over the ranks, in place. x contiguous; inbox: this rank's, of x's dtype, [2 * world * capacity] for
    slots of `capacity` elements; flags: this rank's, int32 [2 * programs * world]; inbox_deltas and flag_deltas:
    int64 [world] on x's device, where each rank's inbox and flags lie from this rank's, in elements (16-byte
    aligned, as torch allocates); abort_address: the host's abort word (int32, pinned); buffer 0 or 1, never the
    same in two consecutive calls (the module's docstring says why). block, warps: elements a program moves at a
    time (a power of two) and its warps, for tuning (benchmarks/all_reduce.py --peer-blocks)."""
    if not x.is_contiguous():
        raise ValueError("peer_sum sums a contiguous tensor in place; make it contiguous first.")
    if inbox.dtype != x.dtype:
        raise ValueError(f"the inbox must be viewed as x's dtype ({x.dtype}), not {inbox.dtype}.")
    numel, capacity, programs = x.numel(), inbox.numel() // (2 * world), flags.numel() // (2 * world)
    if numel > capacity:
        raise ValueError(f"peer_sum's inboxes hold {capacity} elements; this tensor has {numel}.")
    if programs < MAX_PROGRAMS:
        raise ValueError(f"peer_sum's flags must hold {MAX_PROGRAMS} programs a buffer; these hold {programs}.")
    launched, span = launch_shape(numel, block)
    _peer_sum_kernel[(launched,)](
        x, inbox, inbox_deltas, flags, flag_deltas, abort_address, numel, span, capacity, programs,
        BUFFER=buffer, RANK=rank, WORLD=world, BLOCK=block, num_warps=warps, **pdl_arguments(x))
