"""Triton kernels: attention of query rows over one run of paged KV, and the log-sum-exp merge of partials.

One work item = (a run of context positions [kv_start, kv_end) read through a block list, up to
BLOCK_M // GROUP query rows that all read that run). A program takes one item and one KV head: it loads
the rows' query heads of that KV head's group as one [BLOCK_M, D] tile, so a shared prefix is read once
for every row of the item and the scores are a matrix product on the tensor cores. Each (item, row)
writes a normalised partial output and its log2-sum-exp into a slot; the merge kernel combines a row's
slots. Flat paged decode is the special case of one row per item; prefill is items whose rows are
consecutive tokens of one sequence, with the causal mask from each row's position.

Item table columns (int32, ITEM_COLS per item): entry offset, rows, kv_start, kv_end, block offset (block
of position p is block_ids[block_offset + p // BS]), first slot (row j of the item writes slot + j), and the
cache slot of kv_start where the item's blocks are consecutive in the pool (position p at that slot +
p - kv_start), else -1.

Consecutive blocks let a step's K and V tiles come through TMA (TMA=True: tensor descriptors over the cache as
[slots, kv_heads x head_dim]): one copy per tile issued by one thread, instead of every thread computing the
address of each 16 bytes it loads through the block table. A prefix prefilled into a fresh pool lies in
consecutive blocks. Measured in docs/lab/probes/probe_prefix_tma.py (docs/lab/gpu-sessions-23-26.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..kernels.pdl import wait_for_inputs

ITEM_COLS = 7
LOG2E = 1.4426950408889634


@triton.jit
def load_item(ITEMS, item):
    """Item `item`'s columns of the item table (module docstring): entry offset, rows (0: a padding item of a
    fixed grid for CUDA graphs, which does nothing), kv_start, kv_end, block offset, first slot, the slot of
    kv_start in a run of consecutive blocks (-1: not one)."""
    base = ITEMS + item * 7
    return (tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4),
            tl.load(base + 5), tl.load(base + 6))


@triton.jit
def _attend_block(acc, m_i, l_i, q, q_pos, start, hi, K, V, KS, VS, BLOCK_IDS, block_off, kv_head, d,
                  stride_kb, stride_kt, stride_kh, stride_sb, stride_st, qk_scale,
                  BS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                  MASKED: tl.constexpr, K_DESC=None, V_DESC=None, tma_row=0, tma_col=0,
                  TMA: tl.constexpr = False):
    """One BLOCK_N step of online softmax over positions [start, start + BLOCK_N). MASKED: some position is
    past `hi` or past a row's own position (the run's last step, or a prefill tile's diagonal); unmasked
    steps load without predicates and skip the -inf guards, which is most of a long shared prefix.
    TMA (unmasked steps over consecutive blocks of a 16-bit cache): the K and V tiles are the descriptors'
    BLOCK_N rows from (tma_row, tma_col) of the cache seen as [slots, kv_heads x head_dim]."""
    tl.static_assert(not (TMA and (MASKED or FP8)), "TMA tiles are for unmasked steps over a 16-bit cache")
    pos = start + tl.arange(0, BLOCK_N)
    if TMA:
        k = K_DESC.load([tma_row, tma_col])
        v = V_DESC.load([tma_row, tma_col])
    else:
        if MASKED:
            p_valid = pos < hi
            block = tl.load(BLOCK_IDS + block_off + pos // BS, mask=p_valid, other=0)
        else:
            block = tl.load(BLOCK_IDS + block_off + pos // BS)
        slot = block.to(tl.int64) * stride_kb + (pos % BS) * stride_kt + kv_head * stride_kh
        if MASKED:
            k = tl.load(K + slot[:, None] + d[None, :], mask=p_valid[:, None], other=0.0)
            v = tl.load(V + slot[:, None] + d[None, :], mask=p_valid[:, None], other=0.0)
        else:
            k = tl.load(K + slot[:, None] + d[None, :])
            v = tl.load(V + slot[:, None] + d[None, :])
    if FP8:  # e4m3 values are exact in every activation dtype; the scales multiply the scores and p
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        scale_at = block.to(tl.int64) * stride_sb + (pos % BS) * stride_st + kv_head
        if MASKED:  # past-the-end scales may be anything (NaN included): never read them
            s = s * tl.load(KS + scale_at, mask=p_valid, other=0.0)[None, :]
        else:
            s = s * tl.load(KS + scale_at)[None, :]
    s = s * qk_scale
    if MASKED:
        s = tl.where(p_valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        if MASKED:
            p = p * tl.load(VS + scale_at, mask=p_valid, other=0.0)[None, :]
        else:
            p = p * tl.load(VS + scale_at)[None, :]
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _unmasked_steps(acc, m_i, l_i, q, q_pos, lo, full_end, hi, K, V, KS, VS, BLOCK_IDS, block_off, kv_head, d,
                    stride_kb, stride_kt, stride_kh, stride_sb, stride_st, qk_scale,
                    BS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr):
    """The BLOCK_N steps over [lo, full_end) that every row sees whole, through the block table."""
    for start in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_pos, start, hi, K, V, KS, VS, BLOCK_IDS, block_off,
                                      kv_head, d, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, qk_scale,
                                      BS, BLOCK_N, FP8, IEEE, MASKED=False)
    return acc, m_i, l_i


@triton.jit
def segment_attention_kernel(
    Q, K, V, KS, VS, OUT_P, LSE_P, ITEMS, ENTRY_ROWS, ENTRY_POS, BLOCK_IDS,
    K_DESC, V_DESC,  # TMA: descriptors of K and V as [slots, kv_heads x D] with [BLOCK_N, D] boxes; else None
    stride_qt, stride_qh,  # q [T, heads, D]
    stride_kb, stride_kt, stride_kh,  # k/v caches [blocks, BS, kv_heads, D] (views of the pool: own strides)
    stride_sb, stride_st,  # fp8 scales [blocks, BS, kv_heads]
    stride_ps, stride_ph,  # partial outputs [slots, heads, D]; lse [slots, heads] is contiguous
    qk_scale,  # head_dim ** -0.5 * log2(e): scores in the log2 domain
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    WAIT_AT_END: tl.constexpr, TMA: tl.constexpr = False,
):
    # Under PDL (kernels/pdl.py) a launch may start while the kernel before it (RoPE and the KV append) runs.
    # The plan, uploaded before the step, loads before the wait: the item, its rows and their positions, three
    # dependent loads off the critical path. Every program waits, padding ones too: the next launch counts on
    # it. (Loading the first KV tile early as well, all but a row's own new token, made long runs 50% slower:
    # docs/lab/gpu-fast-path.md, sixth session.)
    # A later tile width's launch reads nothing its predecessor (the previous width's launch) writes, so it
    # runs alongside it and waits only before it ends: the merge after it still finds every partial written.
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    entry_off, num_rows, kv_start, kv_end, block_off, slot0, linear_slot = load_item(ITEMS, item)
    m = tl.arange(0, BLOCK_M)
    row_local = m // GROUP
    head = kv_head * GROUP + m % GROUP
    m_valid = row_local < num_rows
    rows = tl.load(ENTRY_ROWS + entry_off + row_local, mask=m_valid, other=0)
    q_pos = tl.load(ENTRY_POS + entry_off + row_local, mask=m_valid, other=-1)
    d = tl.arange(0, HEAD_DIM)
    # Causal: nothing past the last row's position is read (prefill tiles stop at their diagonal).
    hi = tl.minimum(kv_end, tl.max(q_pos, 0) + 1)
    seen_by_all = tl.minimum(hi, tl.min(tl.where(m_valid, q_pos, hi), 0) + 1)  # positions every row may attend
    if not WAIT_AT_END:
        wait_for_inputs(PDL)
    if num_rows > 0:
        q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=m_valid[:, None], other=0.0)
        # Steps below `full_end` see only positions every row may attend (a decode run: all of it but the
        # tail); they run without masks. The rest, the tail and a prefill tile's diagonal, run masked.
        full_end = kv_start + tl.maximum(seen_by_all - kv_start, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if TMA:
            if linear_slot >= 0:  # consecutive blocks: position p sits at slot linear_slot + p - kv_start
                for start in range(kv_start, full_end, BLOCK_N):
                    acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_pos, start, hi, K, V, KS, VS, BLOCK_IDS,
                                                  block_off, kv_head, d, stride_kb, stride_kt, stride_kh, stride_sb,
                                                  stride_st, qk_scale, BS, BLOCK_N, FP8, IEEE, MASKED=False,
                                                  K_DESC=K_DESC, V_DESC=V_DESC,
                                                  tma_row=linear_slot + (start - kv_start),
                                                  tma_col=kv_head * HEAD_DIM, TMA=True)
            else:
                acc, m_i, l_i = _unmasked_steps(acc, m_i, l_i, q, q_pos, kv_start, full_end, hi, K, V, KS, VS,
                                                BLOCK_IDS, block_off, kv_head, d, stride_kb, stride_kt, stride_kh,
                                                stride_sb, stride_st, qk_scale, BS, BLOCK_N, FP8, IEEE)
        else:
            acc, m_i, l_i = _unmasked_steps(acc, m_i, l_i, q, q_pos, kv_start, full_end, hi, K, V, KS, VS, BLOCK_IDS,
                                            block_off, kv_head, d, stride_kb, stride_kt, stride_kh, stride_sb,
                                            stride_st, qk_scale, BS, BLOCK_N, FP8, IEEE)
        for start in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_pos, start, hi, K, V, KS, VS, BLOCK_IDS, block_off,
                                          kv_head, d, stride_kb, stride_kt, stride_kh, stride_sb, stride_st,
                                          qk_scale, BS, BLOCK_N, FP8, IEEE, MASKED=True)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        slot_of = (slot0 + row_local).to(tl.int64)
        tl.store(OUT_P + slot_of[:, None] * stride_ps + head[:, None] * stride_ph + d[None, :],
                 out.to(OUT_P.dtype.element_ty), mask=m_valid[:, None])
        tl.store(LSE_P + slot_of * NUM_HEADS + head, lse, mask=m_valid)
    if WAIT_AT_END:
        wait_for_inputs(PDL)


@triton.jit
def merge_partials_kernel(
    OUT_P, LSE_P, SLOT_INDPTR, SLOTS, OUT,
    stride_ps, stride_ph, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[row, heads] = the softmax-weighted combination of the row's partial outputs (0 for padding rows).

    One program per (row, BLOCK_H heads); it reads BLOCK_S of the row's slots per iteration, so a row with
    many partials (a long prefix cut into chunks) costs a few wide loads instead of one dependent load each.
    The row's slot list is plan data, which no kernel writes: its first BLOCK_S load before the wait (pdl.py).
    """
    row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    first = tl.load(SLOT_INDPTR + row)
    last = tl.load(SLOT_INDPTR + row + 1)
    s = first + tl.arange(0, BLOCK_S)
    first_slots = tl.load(SLOTS + s, mask=s < last, other=0).to(tl.int64)
    wait_for_inputs(PDL)
    d = tl.arange(0, HEAD_DIM)
    h_valid = h < NUM_HEADS
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _merge_slots(acc, m_i, l_i, first_slots, s < last, h, h_valid, d, OUT_P, LSE_P, stride_ps,
                                 stride_ph, NUM_HEADS)
    for s0 in range(first + BLOCK_S, last, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_valid = s < last
        slots = tl.load(SLOTS + s, mask=s_valid, other=0).to(tl.int64)
        acc, m_i, l_i = _merge_slots(acc, m_i, l_i, slots, s_valid, h, h_valid, d, OUT_P, LSE_P, stride_ps,
                                     stride_ph, NUM_HEADS)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + row * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=h_valid[:, None])


@triton.jit
def _merge_slots(acc, m_i, l_i, slot, s_valid, h, h_valid, d, OUT_P, LSE_P, stride_ps, stride_ph,
                 NUM_HEADS: tl.constexpr):
    """Fold partial slots `slot` [BLOCK_S] (where s_valid) into the running log-sum-exp merge of heads h."""
    sh_valid = s_valid[:, None] & h_valid[None, :]
    lse = tl.load(LSE_P + slot[:, None] * NUM_HEADS + h[None, :], mask=sh_valid, other=float("-inf"))
    part = tl.load(OUT_P + slot[:, None, None] * stride_ps + h[None, :, None] * stride_ph + d[None, None, :],
                   mask=sh_valid[:, :, None], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_H, D]
    m_new = tl.maximum(m_i, tl.max(lse, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads with nothing visible yet
    alpha = tl.math.exp2(m_i - m_safe)
    weight = tl.math.exp2(lse - m_safe[None, :])  # [BLOCK_S, BLOCK_H]; 0 for masked slots
    acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], 0)
    l_i = l_i * alpha + tl.sum(weight, 0)
    return acc, m_new, l_i
