"""RoPE on q and k in one launch (HF rotate_half layout), with Qwen3's per-head RMSNorm fused in front of it,
and optionally the step's KV append fused behind it: the rotated k and the v of each token go straight
into their paged-cache slot (a kernel launch per layer less; bf16 / float32 caches, as kv_append writes them).

The angles come from a cos/sin table [T, head_dim] made by model.rope.rope_cos_sin once per forward and shared
by every layer: that keeps the table bit-identical to the reference's, whose float32 cos of large angles
(position * inv_freq reaches 1e5 radians) a fast in-kernel cos would not reproduce.
Rounding follows apply_rope: each product and the sum are rounded to the activation dtype, as torch rounds them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_arguments, wait_for_inputs

# Launch option for kernels that rotate: no mul + add contracted into an FMA. An FMA rounds x * cos + y once where
# torch's eager ops round each product and the sum, so a float32 model's rotated k (and with it an fp8 scale,
# amax / 448) would differ from the reference's in its last bit. bf16 and fp16 round each product explicitly
# (`rotated`), which no contraction crosses.
UNFUSED_FLOAT_OPS = {"enable_fp_fusion": False}


@triton.jit
def rms_normed(x, rstd, weight, dtype: tl.constexpr):
    """x * rstd times the norm weight, both products rounded to the activation dtype as transformer.RMSNorm
    rounds them (float32 values in, float32 values of dtype out)."""
    return (weight * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def rotated(x, partner, cos, sin, sign, dtype: tl.constexpr):
    """x * cos + sign * partner * sin, each product rounded to dtype as apply_rope rounds it: the first half of
    a head takes sign -1 and the second half as partner, the second half +1 and the first (rotate_half)."""
    return (x * cos).to(dtype).to(tl.float32) + sign * (partner * sin).to(dtype).to(tl.float32)


@triton.jit
def _rope_heads(x_ptr, out_ptr, token, x_stride_t, x_stride_h, out_stride_t, out_stride_h, num_heads,
                cos1, cos2, sin1, sin2, weight_ptr, eps,
                HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate one token's heads of x [T, heads, 2 * HALF] into out; cos/sin halves are [1, BLOCK_D] float32."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + token * x_stride_t + heads * x_stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]: first half of each head
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm over the whole head (both halves), as transformer.RMSNorm rounds it
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = rms_normed(x1, rstd, w1, dtype)
        x2 = rms_normed(x2, rstd, w2, dtype)
    first = rotated(x1, x2, cos1, sin1, -1.0, dtype)  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    second = rotated(x2, x1, cos2, sin2, 1.0, dtype)
    dst = out_ptr + token * out_stride_t + heads * out_stride_h + cols
    tl.store(dst, first.to(dtype), mask=mask)
    tl.store(dst + HALF, second.to(dtype), mask=mask)
    return first, second


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
                    q_stride_t, q_stride_h, k_stride_t, k_stride_h, q_out_stride_t, q_out_stride_h,
                    k_out_stride_t, k_out_stride_h, table_stride, num_q_heads, num_k_heads, eps,
                    v_ptr, v_stride_t, v_stride_h, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                    cache_stride_b, cache_stride_s, cache_stride_h,
                    HALF: tl.constexpr, HAS_NORM: tl.constexpr, APPEND: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    in_half = cols < HALF
    row = token * table_stride
    # The table is read once per token for q and k both. It and the slot mapping are made before the forward's
    # first layer, so they load before the wait (pdl.py), while the kernel before is still running.
    cos1 = tl.load(cos_ptr + row + cols, mask=in_half, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + HALF + cols, mask=in_half, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row + cols, mask=in_half, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + HALF + cols, mask=in_half, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + token).to(tl.int64) if APPEND else 0
    wait_for_inputs(PDL)
    _rope_heads(q_ptr, q_out_ptr, token, q_stride_t, q_stride_h, q_out_stride_t, q_out_stride_h, num_q_heads,
                cos1, cos2, sin1, sin2, q_weight_ptr, eps, HALF, HAS_NORM, BLOCK_H, BLOCK_D)
    k1, k2 = _rope_heads(k_ptr, k_out_ptr, token, k_stride_t, k_stride_h, k_out_stride_t, k_out_stride_h,
                         num_k_heads, cos1, cos2, sin1, sin2, k_weight_ptr, eps, HALF, HAS_NORM, BLOCK_H, BLOCK_D)
    if APPEND:  # the rotated k and the raw v into the token's cache slot (cache head vectors are contiguous)
        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < num_k_heads) & in_half
        at = (slot // block_size) * cache_stride_b + (slot % block_size) * cache_stride_s + heads * cache_stride_h + cols
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + at, k1.to(cache_dtype), mask=mask)
        tl.store(k_cache_ptr + at + HALF, k2.to(cache_dtype), mask=mask)
        v_src = v_ptr + token * v_stride_t + heads * v_stride_h + cols
        tl.store(v_cache_ptr + at, tl.load(v_src, mask=mask, other=0.0).to(cache_dtype), mask=mask)
        tl.store(v_cache_ptr + at + HALF, tl.load(v_src + HALF, mask=mask, other=0.0).to(cache_dtype), mask=mask)


def _check_heads(name: str, tensor: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype) -> None:
    if tensor.dim() != 3 or tensor.shape[0] != tokens or tensor.shape[2] != head_dim or tensor.dtype != dtype:
        raise ValueError(f"{name} is {tuple(tensor.shape)} {tensor.dtype}; expected [{tokens}, heads, {head_dim}] "
                         f"{dtype}, matching q.")
    if tensor.stride(2) != 1:
        raise ValueError(f"{name} needs each head vector contiguous (stride 1 along head_dim), got strides "
                         f"{tensor.stride()}.")


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            out: tuple[torch.Tensor, torch.Tensor] | None = None,
            norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
            eps: float = 1e-6,
            append: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] by cos/sin [T, head_dim] -> (q, k) rotated.

    out: (q_out, k_out) to write into; pass (q, k) to rotate in place (they may be views into one qkv
    tensor). None allocates new tensors. norm_weights: Qwen3's (q_norm, k_norm) weights [head_dim], applied
    per head (RMSNorm with `eps`) before the rotation, as the reference does. append: (v, k_cache, v_cache,
    slot_mapping) as kv_append.append_kv takes them, for a cache that is not fp8: the rotated k and v are
    also written there, as append_kv(k_out, v, ...) after this call would write them.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, heads, head_dim], got shape {tuple(q.shape)}.")
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of halves; head_dim must be even, got {head_dim}.")
    _check_heads("q", q, tokens, head_dim, q.dtype)
    _check_heads("k", k, tokens, head_dim, q.dtype)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (tokens, head_dim) or table.dtype != q.dtype or table.stride() != cos.stride():
            raise ValueError(f"{name} is {tuple(table.shape)} {table.dtype} with strides {table.stride()}; expected "
                             f"[{tokens}, {head_dim}] {q.dtype} (from rope_cos_sin), laid out like cos.")
    if cos.stride(1) != 1:
        raise ValueError(f"cos and sin need contiguous rows, got strides {cos.stride()}.")
    q_out, k_out = (torch.empty_like(q), torch.empty_like(k)) if out is None else out
    _check_heads("out[0]", q_out, tokens, head_dim, q.dtype)
    _check_heads("out[1]", k_out, tokens, head_dim, q.dtype)
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError(f"out shapes {tuple(q_out.shape)}, {tuple(k_out.shape)} differ from q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}.")
    if norm_weights is not None:
        for weight in norm_weights:
            if weight.shape != (head_dim,) or weight.dtype != q.dtype:
                raise ValueError(f"norm weight is {tuple(weight.shape)} {weight.dtype}; expected ({head_dim},) "
                                 f"{q.dtype}.")
    q_weight, k_weight = norm_weights if norm_weights is not None else (q, k)  # unread without HAS_NORM
    v, k_cache, v_cache, slots = append if append is not None else (k, k, k, cos)  # unread without APPEND
    if append is not None:
        from .kv_append import check_append

        check_append(k, v, k_cache, v_cache, slots, None, None)
        if k_cache.stride(3) != 1 or v.stride(2) != 1:
            raise ValueError(f"the fused append needs contiguous head vectors in v and the caches; got strides "
                             f"{v.stride()} and {k_cache.stride()}.")
    half = head_dim // 2
    block_h = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_d = triton.next_power_of_2(half)
    _rope_qk_kernel[(tokens,)](
        q, k, q_out, k_out, cos, sin, q_weight, k_weight,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos.stride(0), q.shape[1], k.shape[1], eps,
        v, v.stride(0), v.stride(1), k_cache, v_cache, slots, k_cache.shape[1] if append is not None else 1,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HALF=half, HAS_NORM=norm_weights is not None, APPEND=append is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 1024 else 8, **UNFUSED_FLOAT_OPS, **pdl_arguments(q))
    return q_out, k_out
