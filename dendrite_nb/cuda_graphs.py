"""CUDA graphs for decode steps: the whole decoder (embedding to final norm) replays as one graph.

A decode step of a small model is hundreds of short kernels; launched one by one from Python, the
launch gaps cost more than the kernels (0.6B: ~300 launches). A graph is captured per (batch bucket,
plan shape): the batch is padded to the next bucket and every plan section to a power of two, so one
graph serves many steps of a growing context. Each step's token ids, positions and attention plan go to
the graph's static buffer in one host-to-device copy; padding rows write their KV into the pool's sink
block, own no attention work, and their outputs are dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .attention.base import BatchLayout

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MAX_GRAPHS = 32  # least recently used graphs beyond this are dropped (each holds its plan buffers)


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    bucket: int
    shape: Any  # the backend's PlanShape
    buffer: torch.Tensor  # int32 [2 * bucket + shape.numel]: ids, positions, then the packed plan
    staging: torch.Tensor  # pinned host twin of buffer
    copied: torch.cuda.Event  # the last copy out of staging; staging is rewritten only after it
    hidden: torch.Tensor  # [bucket, hidden] the graph's output
    plan: Any = None  # the plan the graph reads; it owns the partial-result scratch the kernels write


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: Any, kv_layers: list, device: torch.device,
                 block_size: int, sink_slot: int):
        self.model, self.backend, self.kv_layers = model, backend, kv_layers
        self.device, self.block_size, self.sink_slot = device, block_size, sink_slot
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool: graphs replay one at a time
        self.captures = 0  # how many graphs were captured (the tests check that buckets are reused)

    @staticmethod
    def fits(layout: BatchLayout) -> bool:
        return layout.is_decode and len(layout.q_lens) <= BATCH_BUCKETS[-1]

    def run(self, layout: BatchLayout, input_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Hidden states [B, hidden] of one decode step (a fresh tensor); writes the step's KV."""
        rows = len(input_ids)
        bucket = next(b for b in BATCH_BUCKETS if b >= rows)
        host = self.backend.host_plan(layout, self.block_size, self.device)
        need = host.shape()
        captured = next((c for key, c in self._graphs.items() if key[0] == bucket and c.shape.fits(need)), None)
        if captured is None:
            captured = self._capture(bucket, need.padded(bucket), host, input_ids, positions)
        self._graphs.move_to_end((bucket, captured.shape))
        captured.copied.synchronize()
        self._stage(captured, host, input_ids, positions)
        captured.graph.replay()
        return captured.hidden[:rows].clone()

    def _stage(self, captured: _Captured, host: Any, input_ids: list[int], positions: list[int]) -> None:
        pad = captured.bucket - len(input_ids)
        values = torch.tensor(input_ids + [0] * pad + positions + [0] * pad, dtype=torch.int32)
        captured.staging[: 2 * captured.bucket].copy_(values)
        captured.staging[2 * captured.bucket:].copy_(host.pack(captured.shape, self.sink_slot))
        captured.buffer.copy_(captured.staging, non_blocking=True)
        captured.copied.record()

    def _capture(self, bucket: int, shape: Any, host: Any, input_ids: list[int], positions: list[int]) -> _Captured:
        buffer = torch.zeros(2 * bucket + shape.numel, dtype=torch.int32, device=self.device)
        staging = torch.empty(buffer.shape, dtype=torch.int32).pin_memory()
        captured = _Captured(torch.cuda.CUDAGraph(), bucket, shape, buffer, staging, torch.cuda.Event(), buffer)
        ids, pos = buffer[:bucket], buffer[bucket: 2 * bucket]
        plan = self.backend.bind(buffer[2 * bucket:], shape)
        # The warm-up runs this very step for real (its KV writes are the ones the replay repeats): it
        # compiles the kernels and allocates the plan's scratch outside the graph's pool.
        self._stage(captured, host, input_ids, positions)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model(ids, pos, self.kv_layers, self.backend, plan)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.cuda.graph(captured.graph, pool=self._pool):
            captured.hidden = self.model(ids, pos, self.kv_layers, self.backend, plan)
        # The graph holds raw pointers into the plan's scratch: the plan must live as long as the graph.
        captured.plan = plan
        self._graphs[(bucket, shape)] = captured
        self.captures += 1
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return captured
