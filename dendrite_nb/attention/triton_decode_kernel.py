"""Two launches per layer instead of three for a decode step's attention when each work item is one row's
run of at most one KV tile (a few leaves' own contexts, cut into tiles): one kernel does RoPE with Qwen3's
q/k norms, the KV append and the attention of the tile, and merge_partials_kernel combines the tiles after it.
The general path takes rope_qk (with its append), segment_attention_kernel, then the same merge.

Why: a one-row step of a 0.6B model is a chain of about 200 short kernels, and each costs a few microseconds
of dependent latency however little it does (docs/lab/gpu-fast-path.md, eighteenth session). One of them per
layer goes.

Program (item, KV head):
- Before the PDL wait (kernels/pdl.py) it loads what no kernel of this step writes: the plan, the RoPE table
  row, the norm weights, and the item's tile of cached K and V, all but the row's new token (this step's).
  The tile is the program's whole run, so the loads need no loop to overlap the kernel before.
- After it: the row's query heads of this KV head, normed and rotated in registers. If the new token's
  position falls in the tile, its k (normed, rotated) and v go into the cache slot and into the tile.
  An fp8 cache: the tile's scales load before the wait too; the new k and v are quantised as
  kernels/kv_append.py quantises them (the same bytes up to the last bit of the norm's sum), their scales
  stored beside them, and the scores and probabilities are scaled as segment_attention_kernel scales them.
- The tile's attention gives a normalised partial and its log2-sum-exp, written to the plan's scratch
  slot as segment_attention_kernel writes them.

Tried and not kept: the merge in this kernel too, by the program that finishes a row last (a counter per row
and KV head: barrier, release-acquire atomic, barrier, reads through L2). It was slower than the merge launch
it replaced (docs/lab/gpu-fast-path.md, eighteenth session).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..kernels.kv_append import e4m3_scaled
from ..kernels.pdl import wait_for_inputs
from ..kernels.rope import rms_normed, rotated
from .triton_kernels import load_item


@triton.jit
def _normed_rotated_heads(ptr, head_offsets, mask, d, d_partner, cos, sin, sign, weight, weight_partner, eps,
                          HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    """The head vectors at ptr + head_offsets [H] (those where `mask`) -> [H, HEAD_DIM], RMSNorm'd where HAS_NORM
    and rotated, as float32 values of dtype. d_partner: each column's rotate_half partner, (d + HEAD_DIM / 2) %
    HEAD_DIM; sign: -1 for the first half, +1 for the second."""
    x = tl.load(ptr + head_offsets[:, None] + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    partner = tl.load(ptr + head_offsets[:, None] + d_partner[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = rms_normed(x, rstd, weight[None, :], dtype)
        partner = rms_normed(partner, rstd, weight_partner[None, :], dtype)
    return rotated(x, partner, cos[None, :], sin[None, :], sign[None, :], dtype)


@triton.jit
def decode_tile_attention_kernel(
    Q, K_NEW, V_NEW, COS, SIN, Q_NORM, K_NORM, K, V, KS, VS, OUT_P, LSE_P, ITEMS, ENTRY_ROWS, ENTRY_POS,
    BLOCK_IDS, SLOT_MAPPING,
    stride_qt, stride_qh,  # q [T, heads, D]: the raw projection (before norm and RoPE)
    stride_nt, stride_nh,  # the raw k and v [T, kv_heads, D] (views into the same q/k/v product)
    stride_ct,  # the RoPE table cos/sin [T, D]
    stride_kb, stride_kt, stride_kh,  # k/v caches [blocks, BS, kv_heads, D]
    stride_sb, stride_st,  # fp8 scales [blocks, BS, kv_heads] (read only where FP8)
    stride_ps, stride_ph,  # partial outputs [slots, heads, D]; lse [slots, heads] is contiguous
    qk_scale, eps,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr, INV_MAX: tl.constexpr,
    SCALE_FLOOR: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    entry_off, num_rows, kv_start, kv_end, block_off, slot0, _ = load_item(ITEMS, item)  # num_rows: 0 or 1
    row = tl.load(ENTRY_ROWS + entry_off, mask=num_rows > 0, other=0).to(tl.int64)
    q_pos = tl.load(ENTRY_POS + entry_off, mask=num_rows > 0, other=-1)
    hi = tl.minimum(kv_end, q_pos + 1)
    pos = kv_start + tl.arange(0, BLOCK_N)
    in_run = pos < hi
    is_new = pos == q_pos
    block = tl.load(BLOCK_IDS + block_off + pos // BS, mask=in_run, other=0)
    at = block.to(tl.int64) * stride_kb + (pos % BS) * stride_kt + kv_head * stride_kh
    d = tl.arange(0, HEAD_DIM)
    old = (in_run & ~is_new)[:, None]
    k = tl.load(K + at[:, None] + d[None, :], mask=old, other=0.0)
    v = tl.load(V + at[:, None] + d[None, :], mask=old, other=0.0)
    if FP8:  # past-the-end scales may be anything (NaN included): never read them
        scale_at = block.to(tl.int64) * stride_sb + (pos % BS) * stride_st + kv_head
        k_s = tl.load(KS + scale_at, mask=in_run & ~is_new, other=0.0)
        v_s = tl.load(VS + scale_at, mask=in_run & ~is_new, other=0.0)
    else:
        k_s, v_s = 0.0, 0.0  # unread
    half: tl.constexpr = HEAD_DIM // 2
    d_partner = (d + half) % HEAD_DIM
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(COS + row * stride_ct + d).to(tl.float32)
    sin = tl.load(SIN + row * stride_ct + d).to(tl.float32)
    if HAS_NORM:
        q_w = tl.load(Q_NORM + d).to(tl.float32)
        q_w_partner = tl.load(Q_NORM + d_partner).to(tl.float32)
        k_w = tl.load(K_NORM + d).to(tl.float32)
        k_w_partner = tl.load(K_NORM + d_partner).to(tl.float32)
    else:
        q_w, q_w_partner, k_w, k_w_partner = cos, cos, cos, cos  # unread
    new_slot = tl.load(SLOT_MAPPING + row).to(tl.int64)
    wait_for_inputs(PDL)
    if num_rows > 0:
        dtype = Q.dtype.element_ty
        m = tl.arange(0, BLOCK_M)
        m_valid = m < GROUP
        head = kv_head * GROUP + m
        q = _normed_rotated_heads(Q + row * stride_qt, head * stride_qh, m_valid, d, d_partner, cos, sin, sign,
                                  q_w, q_w_partner, eps, HEAD_DIM, HAS_NORM, dtype).to(dtype)
        one = tl.arange(0, 1)
        k_new = _normed_rotated_heads(K_NEW + row * stride_nt, kv_head * stride_nh + one, one == 0, d, d_partner,
                                      cos, sin, sign, k_w, k_w_partner, eps, HEAD_DIM, HAS_NORM, dtype)
        v_new = tl.load(V_NEW + row * stride_nt + kv_head * stride_nh + one[:, None] + d[None, :]).to(tl.float32)
        cache_dtype = K.dtype.element_ty
        if FP8:  # as kernels/kv_append.py quantises: the rotated k as rope_qk stores it, then amax / 448
            k_new, k_new_s = e4m3_scaled(k_new.to(dtype).to(tl.float32), INV_MAX, SCALE_FLOOR)
            v_new, v_new_s = e4m3_scaled(v_new, INV_MAX, SCALE_FLOOR)
            k_s = tl.where(is_new, k_new_s, k_s)
            v_s = tl.where(is_new, v_new_s, v_s)
        if (kv_start <= q_pos) & (q_pos < kv_end):  # the step's token lies in this tile: this program appends it
            new_at = (new_slot // BS) * stride_kb + (new_slot % BS) * stride_kt + kv_head * stride_kh
            tl.store(K + new_at + one[:, None] + d[None, :], k_new.to(cache_dtype))
            tl.store(V + new_at + one[:, None] + d[None, :], v_new.to(cache_dtype))
            if FP8:
                new_scale_at = (new_slot // BS) * stride_sb + (new_slot % BS) * stride_st + kv_head
                tl.store(KS + new_scale_at, k_new_s)
                tl.store(VS + new_scale_at, v_new_s)
        # New names: a value from before this runtime `if` may not change type inside it (fp8 -> dtype).
        k_tile = tl.where(is_new[:, None], k_new.to(cache_dtype), k)
        v_tile = tl.where(is_new[:, None], v_new.to(cache_dtype), v)
        if FP8:  # e4m3 values are exact in any activation dtype; the scales multiply the scores and p
            k_tile = k_tile.to(dtype)
            v_tile = v_tile.to(dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k_tile), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k_tile))
        if FP8:
            s = s * k_s[None, :]
        s = tl.where(in_run[None, :], s * qk_scale, float("-inf"))
        m_i = tl.max(s, 1)  # every row sees position kv_start at least: finite
        p = tl.math.exp2(s - m_i[:, None])
        l_i = tl.sum(p, 1)
        if FP8:
            p = p * v_s[None, :]
        if IEEE:
            acc = tl.dot(p.to(v_tile.dtype), v_tile, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v_tile.dtype), v_tile)
        out = acc / l_i[:, None]
        tl.store(OUT_P + slot0.to(tl.int64) * stride_ps + head[:, None] * stride_ph + d[None, :],
                 out.to(OUT_P.dtype.element_ty), mask=m_valid[:, None])
        tl.store(LSE_P + slot0.to(tl.int64) * NUM_HEADS + head, m_i + tl.math.log2(l_i), mask=m_valid)
