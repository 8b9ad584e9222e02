"""Reference paged attention in plain torch: gathers each sequence's KV through its block table.

It pads the batch to [sequences, longest q, longest context], which is simple and exact but spends
memory on padding; the fast backends read pages directly. An fp8 pool is quantised on write and
dequantised on read with kv/fp8.py, one scale per token and KV head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.fp8 import dequantize, quantize
from .base import BatchLayout, Capabilities, LayerKV


@dataclass(slots=True)
class TorchPlan:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    kv_slots: torch.Tensor  # [B, max_kv] flat cache slot of each context position (0 where padded)
    q_index: torch.Tensor  # [B, max_q] index into the T new tokens (0 where padded)
    q_valid: torch.Tensor  # [B, max_q] bool
    mask: torch.Tensor  # [B, 1, 1, max_q, max_kv] bool: causal and within the context


class TorchAttention:
    name = "torch"
    # Short prefill chunks: every chunk's scores are padded to its whole context.
    capabilities = Capabilities(prefill_chunk_tokens=512)

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, kv_dtype) -> str | None:
        return None  # plain torch runs everywhere

    def plan(self, layout: BatchLayout, block_size: int, device: torch.device) -> TorchPlan:
        batch = len(layout.q_lens)
        max_q, max_kv = max(layout.q_lens), max(layout.kv_lens)
        tables = torch.zeros(batch, -(-max_kv // block_size), dtype=torch.long)
        for i, table in enumerate(layout.block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        kv_pos = torch.arange(max_kv)
        kv_slots = tables[:, kv_pos // block_size] * block_size + kv_pos % block_size  # [B, max_kv]
        q_lens = torch.tensor(layout.q_lens)
        kv_lens = torch.tensor(layout.kv_lens)
        q_offsets = torch.cumsum(q_lens, 0) - q_lens  # first new token of each sequence
        q_j = torch.arange(max_q)
        q_valid = q_j[None, :] < q_lens[:, None]
        q_index = torch.where(q_valid, q_offsets[:, None] + q_j[None, :], 0)
        q_pos = (kv_lens - q_lens)[:, None] + q_j[None, :]  # [B, max_q]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < kv_lens[:, None, None])
        flat_new = torch.cat([kv_slots[i, kv - q: kv] for i, (q, kv) in enumerate(zip(layout.q_lens, layout.kv_lens))])
        return TorchPlan(
            slot_mapping=flat_new.to(device),
            kv_slots=torch.where(kv_pos[None, :] < kv_lens[:, None], kv_slots, 0).to(device),
            q_index=q_index.to(device),
            q_valid=q_valid.to(device),
            mask=mask[:, None, None].to(device),
        )

    def append_kv(self, plan: TorchPlan, kv: LayerKV, k, v) -> None:
        kv_heads, head_dim = k.shape[1:]
        for new, cache, scale in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            if scale is None:
                cache.view(-1, kv_heads, head_dim)[plan.slot_mapping] = new.to(cache.dtype)
            else:
                values, scales = quantize(new)  # [T, KVH, D] fp8, [T, KVH] float32
                cache.view(-1, kv_heads, head_dim)[plan.slot_mapping] = values
                scale.view(-1, kv_heads)[plan.slot_mapping] = scales

    def attend(self, plan: TorchPlan, q, kv: LayerKV) -> torch.Tensor:
        k_cache, v_cache = kv.k, kv.v
        num_heads, head_dim = q.shape[1:]
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        batch, max_q = plan.q_index.shape
        keys = _gather(k_cache, kv.k_scale, plan.kv_slots).permute(0, 2, 1, 3)  # [B, KVH, S, D]
        values = _gather(v_cache, kv.v_scale, plan.kv_slots).permute(0, 2, 1, 3)
        queries = q[plan.q_index].float().view(batch, max_q, kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 3, 1, 4)  # [B, KVH, G, Lq, D]
        scores = torch.matmul(queries, keys[:, :, None].transpose(-1, -2)) * head_dim ** -0.5  # [B, KVH, G, Lq, S]
        scores = scores.masked_fill(~plan.mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values[:, :, None])  # [B, KVH, G, Lq, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_q, num_heads, head_dim)
        return out[plan.q_valid].to(q.dtype)  # [T, H, D]: rows of q_valid in order are the new tokens in order


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KVH, D] at flat slots [B, S] -> float32 [B, S, KVH, D], dequantised if fp8."""
    kv_heads, head_dim = cache.shape[2:]
    gathered = cache.view(-1, kv_heads, head_dim)[slots]
    if scale is None:
        return gathered.float()
    return dequantize(gathered, scale.view(-1, kv_heads)[slots])
