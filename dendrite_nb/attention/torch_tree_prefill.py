"""Tree-aware prefill in plain torch: several sequences' new tokens under shared tree nodes (instructions appended
to forks of one document), each shared node read once for all of them.

A shared node's KV is gathered once and attended by every new token of every sequence under it, in one product
per KV head; those positions all precede the tokens, so nothing is masked. Each sequence's own positions (at
least its new tokens) are gathered padded and attended with a causal mask. The partial results merge by
log-sum-exp, as in tree-aware decode (torch_tree_backend.py). A flat prefill gathers and attends the document
once per sequence instead.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .base import BatchLayout, KVSegment, LayerKV
from .torch_partials import attend_part, gather_by_head, run_slots, segment_slots


@dataclass(slots=True)
class SharedPrefillRead:
    # The new tokens (indices into the forward's T) of every sequence under one tree node: a slice where they
    # are consecutive (the rows under a document forked n ways), read and merged in place; else [Tr] indices.
    tokens: torch.Tensor | slice
    slots: torch.Tensor  # [S] flat cache slot of each of the node's positions (all before those tokens)


@dataclass(slots=True)
class TreePrefillPlan:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    q_index: torch.Tensor  # [B, Lq] index into the T new tokens (0 where padded)
    q_valid: torch.Tensor  # [B, Lq] bool
    private_slots: torch.Tensor  # [B, P] flat slots of each sequence's own positions (0 where padded)
    private_bias: torch.Tensor  # [B, Lq, P] float32: 0 where a token sees the position (causal), -inf elsewhere
    shared: list[SharedPrefillRead]


def plan_tree_prefill(layout: BatchLayout, block_size: int, device: torch.device) -> TreePrefillPlan | None:
    """The plan of a prefill layout with segments, or None where no segment is shared (then a flat read of
    each sequence is the same work). Raises ValueError where a shared segment reaches a sequence's new tokens:
    those are its own (its leaf's), and the layout is wrong."""
    shared = [seg for seg in layout.segments if len(seg.rows) > 1]
    if not shared:
        return None
    q_lens, kv_lens = layout.q_lens, layout.kv_lens
    first_new = [kv - q for q, kv in zip(q_lens, kv_lens)]
    for seg in shared:
        late = [row for row in seg.rows if seg.end > first_new[row]]
        if late:
            raise ValueError(f"a shared segment [{seg.start}, {seg.end}) reaches the new tokens of rows {late} "
                             f"(from {[first_new[row] for row in late]}); a prefill's new tokens must lie in each "
                             "row's own segments, as build_segments cuts them.")
    offsets = list(itertools.accumulate(q_lens[:-1], initial=0))  # each sequence's first new token in T
    slot_mapping = torch.cat([run_slots(table[start // block_size: (kv - 1) // block_size + 1], start, kv, block_size)
                              for table, start, kv in zip(layout.block_tables, first_new, kv_lens)])
    q_lens_t = torch.tensor(q_lens)
    q_j = torch.arange(max(q_lens))
    q_valid = q_j[None, :] < q_lens_t[:, None]
    q_index = torch.where(q_valid, torch.tensor(offsets)[:, None] + q_j[None, :], 0)
    # A padded query row sees every valid position (its position is past them all), so no softmax is empty.
    q_pos = torch.tensor(first_new)[:, None] + q_j[None, :]  # [B, Lq]
    private_slots, private_pos, private_valid = _private_positions(layout.segments, len(q_lens), block_size)
    sees = private_valid[:, None, :] & (private_pos[:, None, :] <= q_pos[:, :, None])  # [B, Lq, P]
    return TreePrefillPlan(
        slot_mapping=slot_mapping.to(device),
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        private_slots=private_slots.to(device),
        private_bias=torch.zeros(sees.shape).masked_fill_(~sees, float("-inf")).to(device),
        shared=[SharedPrefillRead(_tokens_of(seg.rows, offsets, q_lens, device),
                                  segment_slots(seg, block_size).to(device)) for seg in shared],
    )


def attend_tree_prefill(plan: TreePrefillPlan, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]: each sequence's own positions, then each shared read merged."""
    tokens, num_heads, head_dim = q.shape
    kv_heads = kv.k.shape[2]
    group = num_heads // kv_heads
    scale = head_dim ** -0.5
    queries = q.float().view(tokens, kv_heads, group, head_dim)  # [T, KVH, G, D]
    batch, max_q = plan.q_index.shape
    # Own positions: [B, KVH, Lq * G, D] queries (a KV head's group folded into its rows), [B, KVH, P, D] KV.
    padded = queries[plan.q_index].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, max_q * group, head_dim)
    keys = gather_by_head(kv.k, kv.k_scale, plan.private_slots).transpose(0, 1)
    values = gather_by_head(kv.v, kv.v_scale, plan.private_slots).transpose(0, 1)
    bias = plan.private_bias[:, :, None, :].expand(-1, -1, group, -1).reshape(batch, 1, max_q * group, -1)
    own, own_lse = attend_part(padded, keys, values, scale, bias)
    out = own.view(batch, kv_heads, max_q, group, head_dim).transpose(1, 2)[plan.q_valid]  # [T, KVH, G, D]
    lse = own_lse.view(batch, kv_heads, max_q, group).transpose(1, 2)[plan.q_valid]  # [T, KVH, G]
    for read in plan.shared:
        read_queries = queries[read.tokens]  # [Tr, KVH, G, D]
        rows = read_queries.shape[0]
        grouped = read_queries.transpose(0, 1).reshape(1, kv_heads, rows * group, head_dim)
        keys = gather_by_head(kv.k, kv.k_scale, read.slots)[None]  # [1, KVH, S, D]
        values = gather_by_head(kv.v, kv.v_scale, read.slots)[None]
        part, part_lse = attend_part(grouped, keys, values, scale)
        part = part.view(kv_heads, rows, group, head_dim).transpose(0, 1)  # [Tr, KVH, G, D]
        part_lse = part_lse.view(kv_heads, rows, group).transpose(0, 1)  # [Tr, KVH, G]
        # Views of out and lse where the tokens are a slice (merged in place), copies written back otherwise.
        row_out, row_lse = out[read.tokens], lse[read.tokens]
        # The merge weight of the rows' result so far, exp(row_lse - logaddexp(row_lse, part_lse)).
        torch.lerp(part, row_out, torch.sigmoid(row_lse - part_lse).unsqueeze(-1), out=row_out)
        torch.logaddexp(row_lse, part_lse, out=row_lse)
        if not isinstance(read.tokens, slice):
            out[read.tokens], lse[read.tokens] = row_out, row_lse
    return out.reshape(tokens, num_heads, head_dim).to(q.dtype)


def _tokens_of(rows: tuple[int, ...], offsets: list[int], q_lens: list[int],
               device: torch.device) -> torch.Tensor | slice:
    """The new tokens of sequences `rows` (ascending, as build_segments lists them): a slice if consecutive."""
    if rows == tuple(range(rows[0], rows[-1] + 1)):
        return slice(offsets[rows[0]], offsets[rows[-1]] + q_lens[rows[-1]])
    return torch.cat([torch.arange(offsets[row], offsets[row] + q_lens[row]) for row in rows]).to(device)


def _private_positions(segments: list[KVSegment], rows: int,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's own segments' slots and positions, concatenated and padded: [rows, P] long, long, bool."""
    slots: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    positions: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for seg in segments:
        if len(seg.rows) == 1:
            slots[seg.rows[0]].append(segment_slots(seg, block_size))
            positions[seg.rows[0]].append(torch.arange(seg.start, seg.end))
    joined = [torch.cat(parts) for parts in slots]   # every row has its new tokens at least (checked by the plan)
    lengths = torch.tensor([part.numel() for part in joined])
    padded_slots = torch.nn.utils.rnn.pad_sequence(joined, batch_first=True)
    padded_pos = torch.nn.utils.rnn.pad_sequence([torch.cat(parts) for parts in positions], batch_first=True)
    return padded_slots, padded_pos, torch.arange(padded_slots.shape[1])[None, :] < lengths[:, None]
