"""The log-sum-exp merge of attention partials, as a Triton helper that kernels call: the attention backend's
merge kernel (attention/triton_kernels.py), and the one-row GEMV that merges its input itself (gemv.py).

A split attention writes, per (token, head), partial outputs of parts of the context, each normalised over its
part, and each part's log2-sum-exp; merged, they are the softmax over the whole context. Both callers fold slots
in the same groups of BLOCK_S through this one function, so they round alike.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Partials(NamedTuple):
    """A step's unmerged attention: out [slots, heads, head_dim] and lse [slots, heads] (float32, log2 domain),
    which slots each of its `tokens` owns: slots[slot_indptr[t]:slot_indptr[t + 1]] (int32), and how many slots
    a merge folds at a time (block_s: the same grouping rounds the same)."""
    out: torch.Tensor
    lse: torch.Tensor
    slot_indptr: torch.Tensor
    slots: torch.Tensor
    tokens: int
    block_s: int


@triton.jit
def merge_slots(acc, m_i, l_i, slot, s_valid, h, h_valid, d, OUT_P, LSE_P, stride_ps, stride_ph,
                NUM_HEADS: tl.constexpr):
    """Fold partial slots `slot` [BLOCK_S] (where s_valid) into the running log-sum-exp merge of heads h:
    acc [BLOCK_H, D] (unnormalised), m_i and l_i [BLOCK_H]."""
    sh_valid = s_valid[:, None] & h_valid[None, :]
    lse = tl.load(LSE_P + slot[:, None] * NUM_HEADS + h[None, :], mask=sh_valid, other=float("-inf"))
    part = tl.load(OUT_P + slot[:, None, None] * stride_ps + h[None, :, None] * stride_ph + d[None, None, :],
                   mask=sh_valid[:, :, None], other=0.0)  # [BLOCK_S, BLOCK_H, D]
    m_new = tl.maximum(m_i, tl.max(lse, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads with nothing visible yet
    alpha = tl.math.exp2(m_i - m_safe)
    weight = tl.math.exp2(lse - m_safe[None, :])  # [BLOCK_S, BLOCK_H]; 0 for masked slots
    acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], 0)
    l_i = l_i * alpha + tl.sum(weight, 0)
    return acc, m_new, l_i


@triton.jit
def merged_heads(first_slots, first, last, SLOTS, h, h_valid, d, OUT_P, LSE_P, stride_ps, stride_ph,
                 NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Heads h [BLOCK_H] of one token merged over its slots [first, last) -> [BLOCK_H, HEAD_DIM] float32 (0
    where the token has no slot). first_slots: SLOTS[first : first + BLOCK_S], loaded by the caller (plan data,
    which it may load before its PDL wait)."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    s = first + tl.arange(0, BLOCK_S)
    acc, m_i, l_i = merge_slots(acc, m_i, l_i, first_slots, s < last, h, h_valid, d, OUT_P, LSE_P, stride_ps,
                                stride_ph, NUM_HEADS)
    for s0 in range(first + BLOCK_S, last, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_valid = s < last
        slots = tl.load(SLOTS + s, mask=s_valid, other=0).to(tl.int64)
        acc, m_i, l_i = merge_slots(acc, m_i, l_i, slots, s_valid, h, h_valid, d, OUT_P, LSE_P, stride_ps,
                                    stride_ph, NUM_HEADS)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
