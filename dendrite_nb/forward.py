"""One model forward over runs of tokens just appended to the branch tree, in two halves.

plan() needs only where each run lies (its node, its length): the block tables, the KV segments, the
copy-on-write copies and the attention plan, staged into a CUDA graph's buffer where a graph replays the
step. run() needs the token ids and launches the forward. A decode step plans while the GPU still runs
the previous step, and runs as soon as its tokens are sampled: the host's bookkeeping then hides behind
the GPU instead of leaving it idle between steps.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .attention import AttentionBackend, BatchLayout
from .kv import AppendRecord, BranchTree, KVPool
from .kv.cascade import SegmentCache, build_segments


@dataclass(slots=True)
class PlannedForward:
    records: list[AppendRecord]
    layout: BatchLayout
    staged: Any = None  # a graph step staged by ForwardGraphs.prepare, or None for an eager forward
    plan: Any = None  # the backend's plan of an eager forward
    positions: torch.Tensor | None = None  # [T] of an eager forward, on the device


class ForwardRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pool: KVPool, kv_layers: list, graphs: Any,
                 device: torch.device, tensor_group: Any = None):
        self.model, self.backend, self.pool, self.kv_layers = model, backend, pool, kv_layers
        self.graphs, self.device = graphs, device
        # A tensor-parallel engine's workers (distributed/group.py): each forward's layout and token ids go to them
        # before rank 0 runs its own shard. None: the whole model runs here.
        self.tensor_group = tensor_group
        self.segments = SegmentCache()
        # The last forward's hidden states [T, hidden] and their row views (what nodes hold as last_hidden):
        # the next step's LM head reads the tensor as it is when it asks for exactly those rows, in order.
        self.last_hidden: torch.Tensor | None = None
        self.last_rows: list[torch.Tensor] = []
        # Set while the engine scores appended tokens: the last forward's hidden state of every token [T, hidden].
        self.keep_all_hidden = False
        self.all_hidden: torch.Tensor | None = None
        # Host landing places of what a step reads back (read_back): the sampled tokens, and their
        # log-probabilities when asked for, by position in the call.
        self._pinned: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def plan(self, tree: BranchTree, records: list[AppendRecord], q_lens: list[int]) -> PlannedForward:
        """Everything of the forward but the token ids. Launches the copy-on-write block copies."""
        tables = [tree.block_table(record.node) for record in records]
        segments = None
        capabilities = self.backend.capabilities
        if capabilities.tree_segments and all(q == 1 for q in q_lens):  # a decode step: shared once
            segments = self.segments.segments(tree, [record.node for record in records], tables)
        elif capabilities.tree_prefill and len(records) > 1:  # a prefill of several runs, maybe under shared nodes
            segments = build_segments(tree, [record.node for record in records], tables)
        layout = BatchLayout(q_lens=q_lens, kv_lens=[record.node.end for record in records], block_tables=tables,
                             segments=segments)
        copies = [record.cow for record in records if record.cow is not None]  # (source, target) block pairs
        if copies:
            pairs = self._on_device(copies)  # [copies, 2]: one host-to-device copy
            self.pool.copy_blocks(pairs[:, 0], pairs[:, 1])
        planned = PlannedForward(records, layout)
        reuse = {}
        if self.graphs is not None and self.graphs.fits(layout):
            staged = self.graphs.prepare(layout)
            if staged.replays:
                planned.staged = staged
                return planned
            reuse["host"] = staged.host  # a prefill shape met for the first time runs eagerly (cuda_graphs.py)
        planned.plan = self.backend.plan(layout, self.pool.block_size, self.device, **reuse)
        planned.positions = self._on_device(layout.positions)
        return planned

    def _on_device(self, values) -> torch.Tensor:
        """A long tensor of `values` (a list, or a list of equal-length tuples) on the device, copied from pinned memory without waiting: a copy from
        pageable memory (torch.tensor(values, device=...)) first waits for all the work queued on the stream,
        so the host could not plan the next forward while the GPU runs this one."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def run(self, planned: PlannedForward, token_ids: list[int] | torch.Tensor) -> None:
        """Write the tokens' KV and set each run's node.last_hidden (the final hidden state of its last token).
        token_ids: a list, or a [T] tensor already on the device (a decode step's sampled tokens)."""
        layout = planned.layout
        if not isinstance(token_ids, torch.Tensor):
            token_ids = self._on_device(token_ids)
        if planned.staged is not None:
            hidden = self.graphs.launch(planned.staged, token_ids)  # [T, hidden]
        elif self.tensor_group is not None:   # every rank runs its shard of it
            hidden = self.tensor_group.forward(layout, token_ids, self.model, planned.positions, self.kv_layers,
                                               self.backend, planned.plan)
        else:
            hidden = self.model(token_ids, planned.positions, self.kv_layers, self.backend, planned.plan)
        self.all_hidden = hidden if self.keep_all_hidden else None
        if not layout.is_decode:  # keep each sequence's last token (a host-built index: no device sync)
            hidden = hidden[self._on_device(list(itertools.accumulate(layout.q_lens, initial=-1)))[1:]]
        rows = list(hidden)
        for record, row in zip(planned.records, rows):
            record.node.last_hidden = row
        self.last_hidden, self.last_rows = hidden, rows

    def read_back(self, *tensors: torch.Tensor) -> Callable[[], list[list]]:
        """Start copying the 1-D `tensors` (on the device) to the host; the returned function waits for that
        copy alone, so work queued after this call (the step's forward) keeps running while the host reads."""
        if tensors[0].device.type != "cuda":
            return lambda: [tensor.tolist() for tensor in tensors]
        if self._copied is None:
            self._copied = torch.cuda.Event()
        hosts = []
        for slot, tensor in enumerate(tensors):
            pinned = self._pinned.get((slot, tensor.dtype))
            if pinned is None or len(pinned) < len(tensor):
                pinned = torch.empty(max(len(tensor), 256), dtype=tensor.dtype, pin_memory=True)
                self._pinned[(slot, tensor.dtype)] = pinned
            host = pinned[: len(tensor)]
            host.copy_(tensor, non_blocking=True)
            hosts.append(host)
        self._copied.record()
        copied = self._copied

        def wait() -> list[list]:
            if self.tensor_group is None:
                copied.synchronize()
            else:   # a worker dead or hung in the step is an error, not a hang
                self.tensor_group.wait_for(copied)
            return [host.tolist() for host in hosts]
        return wait

    def hidden_of(self, nodes: list) -> torch.Tensor:
        """[B, hidden]: each node's last_hidden, stacked; or the last forward's output itself when these
        nodes' states are its rows, in order (the usual decode step: no gather)."""
        rows = self.last_rows
        if len(nodes) == len(rows) and all(node.last_hidden is row for node, row in zip(nodes, rows)):
            return self.last_hidden
        return torch.stack([node.last_hidden for node in nodes])
