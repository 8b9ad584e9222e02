"""CUDA graphs for decode steps and short prefills: the whole decoder (embedding to final norm) replays as one
graph.

A forward of a small model is hundreds of short kernels; launched one by one from Python, the launch gaps
cost more than the kernels (0.6B: ~300 launches, about 10 ms of host time against well under 1 ms on an
H200's GPU). A graph is captured per (token bucket, plan shape): the tokens are padded to the next bucket
and every plan section to a power of two, so one graph serves many steps of a growing context. A step is
prepared before its tokens exist: positions and attention plan go to the graph's static buffer in one
host-to-device copy (queued behind the step still running). It is launched once the sampler has written the
tokens on the device: a device copy puts them in the buffer, no trip through the host. Padding tokens write
their KV into the pool's sink block, own no attention work, and their outputs are dropped.

A graph does not care whether its tokens are one per row (a decode step) or runs of one sequence (a prefill:
the plan's items carry the causal mask), so short prefills replay graphs too: forked branches each given a
short instruction reach their first token without an eager forward. A decode shape is
captured the first time it comes up, since decoding repeats it step after step; a prefill shape only the
second time (capturing cost about three eager forwards on an H200, 67 against 23 ms for 10 instructions of
a 0.6B model, and a one-off prompt would never earn that back).

On a tensor-parallel engine (distributed/) every rank keeps the same graphs, with the step's collectives inside:
the token ids' broadcast from rank 0 first, then the all-reduces of the layers. Rank 0 alone decides, as above;
each launch first tells the workers which graph to capture or replay (its key), the packed positions and plan to
put in its buffer, and which graphs to drop, so that every rank captures, replays and evicts the same graphs in
the same order: the collectives of the replays pair up rank by rank.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .attention.base import BatchLayout, CapturableBackend

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # tokens per graph
# Prefills replay graphs when each sequence brings at most PREFILL_GRAPH_RUN_TOKENS (an instruction, a message)
# and all of them at most PREFILL_GRAPH_TOKENS. A long document's chunks stay eager: each chunk's context
# differs, so their shapes rarely repeat, and capturing them evicted graphs that did (docs/lab/gpu-many-branches.md).
PREFILL_GRAPH_RUN_TOKENS = 128
PREFILL_GRAPH_TOKENS = 1024
SEEN_PREFILL_SHAPES = 256  # prefill shapes remembered for their second sighting (least recently seen dropped)
MAX_GRAPHS = 32  # least recently used graphs beyond this are dropped (each holds its plan buffers)
# The BLAS library a graph captures for products of more rows than kernels/skinny.py takes: cuBLASLt ran steps of
# many leaves faster (REPORT "Fork, first decode step of 1,000 leaves, memory"; the runs:
# docs/lab/constants-history.md). Eager forwards keep torch's default.
GRAPH_BLAS_LIBRARY = "cublaslt"


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    bucket: int
    shape: Any  # the backend's PlanShape
    buffer: torch.Tensor  # int32 [2 * bucket + shape.numel]: ids, positions, then the packed plan
    staging: torch.Tensor  # pinned host twin of buffer (its ids part unused: ids are copied on the device)
    copied: torch.cuda.Event  # the last copy out of staging; staging is rewritten only after it
    hidden: torch.Tensor  # [bucket, hidden] the graph's output
    plan: Any = None  # the plan the graph reads; it owns the partial-result scratch the kernels write


@dataclass(slots=True)
class _Staged:
    bucket: int
    host: Any  # the backend's host plan
    positions: list[int]  # one per token
    captured: _Captured | None = None  # None: no graph of this bucket and shape yet
    capture: bool = True  # with no graph yet: capture one at launch (False: the step runs eagerly)
    packed: np.ndarray | None = None  # int32 [bucket + plan]: what was uploaded to captured's buffer

    @property
    def replays(self) -> bool:
        """Whether launch() runs this step through a graph (one it has, or one it captures)."""
        return self.captured is not None or self.capture


class ForwardGraphs:
    def __init__(self, model: torch.nn.Module, backend: CapturableBackend, kv_layers: list, device: torch.device,
                 block_size: int, sink_slot: int, tensor_group: Any = None,
                 broadcast: Callable[[torch.Tensor], None] | None = None,
                 launched: Callable[[], None] | None = None):
        """tensor_group: rank 0's TensorGroup of a tensor-parallel engine (whose workers follow each launch);
        broadcast: on every rank of one, what sends rank 0's token ids to the others (inside each graph);
        launched: on every rank of one, what is told of each graph launched (Channels.graph_launched)."""
        self.model, self.backend, self.kv_layers = model, backend, kv_layers
        self.device, self.block_size, self.sink_slot = device, block_size, sink_slot
        self.tensor_group, self.broadcast, self.launched = tensor_group, broadcast, launched
        if tensor_group is not None:
            tensor_group.before_shutdown.append(self.release)
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool: graphs replay one at a time
        self._seen_prefills: OrderedDict[tuple, None] = OrderedDict()  # (bucket, padded shape) met once
        self.captures = 0  # how many graphs were captured (the tests check that buckets are reused)

    @staticmethod
    def fits(layout: BatchLayout) -> bool:
        if layout.is_decode:
            return len(layout.q_lens) <= BATCH_BUCKETS[-1]
        return max(layout.q_lens) <= PREFILL_GRAPH_RUN_TOKENS and sum(layout.q_lens) <= PREFILL_GRAPH_TOKENS

    def prepare(self, layout: BatchLayout) -> _Staged:
        """The token-free half of a step: its positions and plan sent to the graph that will replay it. The
        copy is queued behind the work already on the stream (the step still running reads this buffer).
        A prefill whose shape has no graph and was not seen before gets `capture` False: run it eagerly
        from `host` (ForwardRunner does)."""
        positions = layout.positions
        bucket = next(b for b in BATCH_BUCKETS if b >= len(positions))
        host = self.backend.host_plan(layout, self.block_size, self.device)
        need = host.shape()
        staged = _Staged(bucket, host, positions)  # made once: the upload below reuses them
        staged.captured = next((c for key, c in self._graphs.items() if key[0] == bucket and c.shape.fits(need)),
                               None)
        if staged.captured is not None:
            self._graphs.move_to_end((bucket, staged.captured.shape))
            staged.packed = self._packed(bucket, staged.captured.shape, host, positions)
            self._upload(staged.captured, staged.packed)
        elif not layout.is_decode:
            key = (bucket, need.padded(bucket))
            staged.capture = key in self._seen_prefills
            self._seen_prefills[key] = None
            self._seen_prefills.move_to_end(key)
            while len(self._seen_prefills) > SEEN_PREFILL_SHAPES:
                self._seen_prefills.popitem(last=False)
        return staged

    def launch(self, staged: _Staged, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step (a fresh tensor); writes its KV. input_ids: [T] on the device
        (a decode step's are the sampler's output: no trip through the host). The graph is captured here
        when a bucket and plan shape have none yet and staged.capture (capturing runs the step once for real)."""
        if not staged.replays:
            raise RuntimeError("this step was staged to run eagerly (capture False); ForwardRunner runs it.")
        bucket, captured, group = staged.bucket, staged.captured, self.tensor_group
        tokens = len(staged.positions)
        in_step = contextlib.nullcontext() if group is None else group.lockstep("a CUDA graph step")
        if captured is None:
            shape = staged.host.shape().padded(bucket)
            packed = self._packed(bucket, shape, staged.host, staged.positions)
            dropped = self._make_room()
            if group is not None:
                group.command("graph", (bucket, shape), packed, True, dropped)
            with in_step:
                captured = self._capture(bucket, shape, packed, input_ids)
                self._replay(captured)   # the graph's output exists only once it has run
        else:
            captured.buffer[:tokens].copy_(input_ids)  # padding tokens keep older ids: any valid id will do
            if group is not None:
                group.command("graph", (bucket, captured.shape), staged.packed, False, [])
            with in_step:
                self._replay(captured)
        return captured.hidden[:tokens].clone()

    def follow(self, key: tuple, packed: np.ndarray, capture: bool, dropped: list[tuple]) -> None:
        """A tensor-parallel worker's side of rank 0's launch(): drop the graphs it dropped, then capture or
        replay graph `key` with `packed` in its buffer (the token ids arrive by the graph's broadcast)."""
        for old in dropped:
            self._graphs.pop(old, None)
        bucket, shape = key
        if capture:
            captured = self._capture(bucket, shape, packed, None)
        else:
            captured = self._graphs.get(key)
            if captured is None:
                raise RuntimeError(f"rank 0 replays a CUDA graph this worker does not hold ({bucket} tokens)")
            self._graphs.move_to_end(key)
            self._upload(captured, packed)
        self._replay(captured)

    def _replay(self, captured: _Captured) -> None:
        captured.graph.replay()
        if self.launched is not None:
            self.launched()

    def release(self) -> None:
        """Destroy every graph now. A tensor-parallel engine's NCCL communicator cannot be aborted while a graph
        that captured its collectives exists (NCCL counts them and waits), so the group calls this first."""
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()

    def _make_room(self) -> list[tuple]:
        """Drop the least recently used graphs until one more fits; their keys (a tensor-parallel engine's
        workers drop the same ones)."""
        dropped = []
        while len(self._graphs) >= MAX_GRAPHS:
            dropped.append(self._graphs.popitem(last=False)[0])
        return dropped

    def _packed(self, bucket: int, shape: Any, host: Any, positions: list[int]) -> np.ndarray:
        """int32 [bucket + shape.numel]: the step's positions, padded to the bucket, and its packed plan."""
        packed = np.zeros(bucket + shape.numel, dtype=np.int32)
        packed[: len(positions)] = positions
        packed[bucket:] = host.pack(shape, self.sink_slot).numpy()
        return packed

    def _upload(self, captured: _Captured, packed: np.ndarray) -> None:
        """Positions and plan into the graph's buffer, through its pinned staging twin (the ids come at launch)."""
        bucket = captured.bucket
        # The staging buffer's last copy has run: it may be rewritten.
        if self.tensor_group is None:
            captured.copied.synchronize()
        else:   # behind the replays queued before it: a worker dead or hung in them is an error, not a hang
            self.tensor_group.wait_for(captured.copied)
        captured.staging.numpy()[bucket:] = packed
        captured.buffer[bucket:].copy_(captured.staging[bucket:], non_blocking=True)
        captured.copied.record()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: Any) -> torch.Tensor:
        if self.broadcast is not None:   # a tensor-parallel rank: rank 0's ids into every rank's buffer
            self.broadcast(ids)
        return self.model(ids, positions, self.kv_layers, self.backend, plan)

    def _capture(self, bucket: int, shape: Any, packed: np.ndarray, input_ids: torch.Tensor | None) -> _Captured:
        """Capture the graph of (bucket, shape), running the step once for real first. input_ids: [T] on the
        device; None on a tensor-parallel worker, whose ids come by the broadcast."""
        from .kernels.products import graph_products  # Triton's products: imported where a GPU captures

        buffer = torch.zeros(2 * bucket + shape.numel, dtype=torch.int32, device=self.device)
        staging = torch.empty(buffer.shape, dtype=torch.int32).pin_memory()
        captured = _Captured(torch.cuda.CUDAGraph(), bucket, shape, buffer, staging, torch.cuda.Event(), buffer)
        ids, pos = buffer[:bucket], buffer[bucket: 2 * bucket]
        plan = self.backend.bind(buffer[2 * bucket:], shape)
        # The warm-up runs this very step for real (its KV writes are the ones the replay repeats): it
        # compiles the kernels and allocates the plan's scratch outside the graph's pool. Both run the
        # products that graphs take (graph_products: few rows to skinny; more through cuBLASLt).
        self._upload(captured, packed)
        if input_ids is not None:
            ids[: len(input_ids)].copy_(input_ids)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        # A tensor-parallel rank's NCCL watchdog thread queries the events of earlier collectives while this
        # thread captures: the global mode would take that for an illegal call inside the capture.
        mode = "global" if self.broadcast is None else "thread_local"
        with blas_library(GRAPH_BLAS_LIBRARY), graph_products():
            with torch.cuda.stream(side):
                self._forward(ids, pos, plan)
            torch.cuda.current_stream(self.device).wait_stream(side)
            with torch.cuda.graph(captured.graph, pool=self._pool, capture_error_mode=mode):
                captured.hidden = self._forward(ids, pos, plan)
        # The graph holds raw pointers into the plan's scratch: the plan must live as long as the graph.
        captured.plan = plan
        self._graphs[(bucket, shape)] = captured
        self.captures += 1
        return captured


@contextlib.contextmanager
def blas_library(name: str):
    """torch's preferred BLAS library set to `name` inside the block, and put back after it; left as it is
    where this torch build lacks that library (torch refuses the setting)."""
    def prefer(*library: str):
        with warnings.catch_warnings():  # torch marks the preference experimental, in a warning per process
            warnings.simplefilter("ignore")
            return torch.backends.cuda.preferred_blas_library(*library)
    previous = prefer()
    try:
        prefer(name)
    except RuntimeError:
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            prefer(previous)
