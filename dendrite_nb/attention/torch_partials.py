"""Partial attention in plain torch: the pieces that tree-aware attention (torch_tree_backend.py for decode,
torch_tree_prefill.py for prefill) is built from.

Tree-aware attention reads a context in parts (a shared node once for all the rows under it, each row's own
positions apart) and merges the parts' results by log-sum-exp. Here: the flat cache slots of a run of positions,
a gather of slots with the KV heads in front, and attention over one part that returns each query's log-sum-exp
beside its output.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv.fp8 import dequantize
from .base import KVSegment


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def run_slots(blocks: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """[end - start] flat slots of positions [start, end); `blocks` holds logical block start // size onwards."""
    positions = torch.arange(start, end)
    physical = torch.tensor(blocks, dtype=torch.long)
    return physical[positions // block_size - start // block_size] * block_size + positions % block_size


def segment_slots(segment: KVSegment, block_size: int) -> torch.Tensor:
    """[end - start] flat slots of a segment's positions."""
    return run_slots(segment.blocks, segment.start, segment.end, block_size)


def gather_by_head(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KVH, D] at flat slots [...] -> float32 [KVH, ..., D], dequantised if fp8.

    Whole slots are gathered first (index_select copies each slot's KVH x D values as one run), then one more
    copy puts the KV heads in front as float32: half the time of indexing a head-major view slot by slot, which
    copies D values at a time (one 0.6B leaf's 512 positions on two cores: 131 against 302 us a layer for K in
    bf16, 135 against 270 in float32). The result is contiguous because the products over many rows' private
    positions ran slower on a strided one (16 bf16 leaves: 219 against 192 ms a step)."""
    kv_heads, head_dim = cache.shape[2:]
    flat = slots.reshape(-1)
    gathered = cache.view(-1, kv_heads * head_dim).index_select(0, flat).view(*slots.shape, kv_heads, head_dim)
    if scale is None:
        return gathered.movedim(-2, 0).to(torch.float32, memory_format=torch.contiguous_format)
    scales = scale.view(-1, kv_heads).index_select(0, flat).view(*slots.shape, kv_heads)
    return dequantize(gathered, scales).movedim(-2, 0).contiguous()


def softmax_times(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scores) @ values, logsumexp(scores)) over the last axis; the lse keeps a trailing axis of 1."""
    top = scores.amax(dim=-1, keepdim=True)
    weights = (scores - top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, values).div_(total), top + total.log()


def attend_part(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of float32 queries [N, KVH, M, D] over keys and values [N, KVH, S, D] (each KV head's M query
    vectors: a group's heads folded into M), with an additive bias [N, 1, M, S] (0 or -inf) or none: (out
    [N, KVH, M, D], lse [N, KVH, M]). No row may be masked whole.

    On a CPU this is the flash kernel that scaled_dot_product_attention runs there, called directly because
    the public call drops the log-sum-exp. It never writes the [M, S] scores out: 32 forks' 16-token
    instructions over one 2,000-token document at SmolLM2-135M's heads (3 KV heads, 3 query heads each), 18
    against 75 ms a layer for the scores written out and softmaxed (attend_part_written_out) on two quiet
    cores. Elsewhere (the torch-tree backend on a GPU) the scores are written out."""
    if queries.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(queries, keys, values, attn_mask=bias,
                                                                           scale=scale)
    return attend_part_written_out(queries, keys, values, scale, bias)


def attend_part_written_out(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_part with the scores [N, KVH, M, S] written out, on any device."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores += bias
    out, lse = softmax_times(scores, values)
    return out, lse.squeeze(-1)
