"""Tree-aware attention in plain torch: the fast path on a CPU, where the Triton kernels do not run.

A decode step over leaves that share tree nodes reads each shared node's KV once for all its rows, as the
Triton backend does: one gather of the node's positions and one product against all the rows' query heads
at once (a matrix product, where flat attention does one thin product per row). Each row's own positions
(everything no other row reads, at least the leaf's newest token) are gathered and attended padded, as the
reference does. The partial results are merged by log-sum-exp. A prefill of several sequences under shared
nodes (instructions appended to forks of one document) is read the same way, by torch_tree_prefill.py.
A prefill without shared nodes (and any step without segments) plans as the reference does and attends
through torch's scaled_dot_product_attention, which on a CPU never writes out the padded
[rows, heads, queries, context] scores that the reference scales, masks and softmaxes in separate passes: a
512-token chunk over 1,024 positions of the 0.6B model, 31 against 75 ms a layer on two cores.

Its products group the query heads by KV head ([KV heads, rows, group, head_dim]), so keys and values are
never copied once per query head of a group, which the reference's broadcasting does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .base import BatchLayout, Capabilities, KVSegment, LayerKV
from .torch_backend import TorchAttention, TorchPlan, _gather
from .torch_partials import gather_by_head, segment_slots, slot_of, softmax_times
from .torch_tree_prefill import TreePrefillPlan, attend_tree_prefill, plan_tree_prefill


@dataclass(slots=True)
class SharedRead:
    rows: torch.Tensor  # [R] batch rows that read these positions (all R descend from one tree node)
    slots: torch.Tensor  # [S] flat cache slot of each position


@dataclass(slots=True)
class TreeDecodePlan:
    slot_mapping: torch.Tensor  # [B] flat cache slot of each row's new token
    private_slots: torch.Tensor  # [B, P] flat slots of each row's own positions (0 where padded)
    private_valid: torch.Tensor  # [B, P] bool
    shared: list[SharedRead]


class TorchTreeAttention(TorchAttention):
    name = "torch-tree"
    # Short prefill chunks too: SDPA computes the masked half of a chunk's explicit mask (REPORT "Tree of thought
    # and prefill on the CPU"; the run: docs/lab/constants-history.md).
    capabilities = Capabilities(tree_segments=True, tree_prefill=True, prefill_chunk_tokens=512)

    def plan(self, layout: BatchLayout, block_size: int, device: torch.device):
        if layout.segments is None:
            return super().plan(layout, block_size, device)
        if not layout.is_decode:
            return plan_tree_prefill(layout, block_size, device) or super().plan(layout, block_size, device)
        shared = [seg for seg in layout.segments if len(seg.rows) > 1]
        private = sorted((seg for seg in layout.segments if len(seg.rows) == 1), key=lambda seg: seg.rows[0])
        slot_mapping = [slot_of(table, kv - 1, block_size) for table, kv in zip(layout.block_tables, layout.kv_lens)]
        private_slots, private_valid = _padded_slots(private, len(layout.kv_lens), block_size)
        return TreeDecodePlan(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(device),
            private_slots=private_slots.to(device),
            private_valid=private_valid.to(device),
            shared=[SharedRead(torch.tensor(seg.rows, dtype=torch.long).to(device),
                               segment_slots(seg, block_size).to(device)) for seg in shared],
        )

    def attend(self, plan, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if isinstance(plan, TreePrefillPlan):
            return attend_tree_prefill(plan, q, kv)
        if not isinstance(plan, TreeDecodePlan):
            return _attend_padded(plan, q, kv)
        rows, num_heads, head_dim = q.shape
        kv_heads = kv.k.shape[2]
        group = num_heads // kv_heads
        scale = head_dim ** -0.5
        queries = q.float().view(rows, kv_heads, group, head_dim).transpose(0, 1)  # [KVH, B, G, D]
        keys = gather_by_head(kv.k, kv.k_scale, plan.private_slots)  # [KVH, B, P, D]
        values = gather_by_head(kv.v, kv.v_scale, plan.private_slots)
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)  # [KVH, B, G, P]
        scores.masked_fill_(~plan.private_valid[None, :, None, :], float("-inf"))
        # Every row has a private position (its leaf's newest token), so no row of scores is all -inf.
        out, lse = softmax_times(scores, values)  # [KVH, B, G, D], [KVH, B, G, 1]
        for read in plan.shared:
            shared_rows = read.rows.numel()
            keys = gather_by_head(kv.k, kv.k_scale, read.slots)  # [KVH, S, D]
            values = gather_by_head(kv.v, kv.v_scale, read.slots)
            grouped = queries[:, read.rows].reshape(kv_heads, shared_rows * group, head_dim)
            scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scale)  # [KVH, R * G, S]
            part, part_lse = softmax_times(scores, values)
            part = part.view(kv_heads, shared_rows, group, head_dim)
            part_lse = part_lse.view(kv_heads, shared_rows, group, 1)
            row_lse = lse[:, read.rows]
            merged = torch.logaddexp(row_lse, part_lse)
            out[:, read.rows] = out[:, read.rows] * (row_lse - merged).exp() + part * (part_lse - merged).exp()
            lse[:, read.rows] = merged
        return out.transpose(0, 1).reshape(rows, num_heads, head_dim).to(q.dtype)


def _attend_padded(plan: TorchPlan, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
    """The reference's padded attention (torch_backend.py) through scaled_dot_product_attention."""
    keys = _gather(kv.k, kv.k_scale, plan.kv_slots).transpose(1, 2)  # [B, KVH, S, D]
    values = _gather(kv.v, kv.v_scale, plan.kv_slots).transpose(1, 2)
    queries = q[plan.q_index].float().transpose(1, 2)  # [B, H, Lq, D]
    # Query head h reads KV head h // group, as in the reference; no padded row is masked whole (each sees
    # its sequence's context), so no row's softmax is empty.
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask[:, 0], enable_gqa=True)
    return out.transpose(1, 2)[plan.q_valid].to(q.dtype)  # [T, H, D]


def _padded_slots(private: list[KVSegment], rows: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's private segments' slots, concatenated and padded: ([rows, P] long, [rows, P] bool)."""
    per_row: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for segment in private:
        per_row[segment.rows[0]].append(segment_slots(segment, block_size))
    joined = [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in per_row]
    slots = torch.nn.utils.rnn.pad_sequence(joined, batch_first=True)
    lengths = torch.tensor([part.numel() for part in joined])
    if rows and int(lengths.min()) == 0:   # a leaf's own node holds its newest token, so this is a layout bug
        raise ValueError(f"a decode row reads no position of its own (rows {lengths.eq(0).nonzero().flatten().tolist()}); "
                         "each row's leaf must be its own node, as decode_layout builds it.")
    return slots, torch.arange(slots.shape[1])[None, :] < lengths[:, None]
