"""Triton kernel that writes new tokens' K and V into the paged KV cache, quantising to fp8 on the way.

    append_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None

    k, v              [T, kv_heads, head_dim], float32 / bfloat16 / float16, any strides.
    k_cache, v_cache  [num_blocks, block_size, kv_heads, head_dim], views of the pool (LayerKV.k / .v);
                      their strides are used, and must be equal (both are slices of one pool).
    slot_mapping      [T] int32 or int64 on the caches' device: the flat slot block * block_size + offset
                      each token goes to, in range (nothing checks it on the device; padding rows of a CUDA
                      graph write to the pool's sink block, KVPool.sink_slot).
    k_scale, v_scale  [num_blocks, block_size, kv_heads] float32 (LayerKV.k_scale / .v_scale): required when
                      the caches are float8_e4m3fn, None otherwise. Each head vector x is stored as
                      x / s in e4m3 with s = max|x| * (1/448) written alongside, the arithmetic of
                      dendrite_nb.kv.fp8.quantize in the same order, so both write the same bytes.

One launch writes K and V; nothing is read back to the host, so a CUDA graph can capture it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv.fp8 import FP8_DTYPE, INV_FP8_MAX, MIN_SCALE
from .pdl import pdl_arguments, wait_for_inputs


@triton.jit
def e4m3_scaled(x, INV_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr):
    """One head vector x (float32, any shape) -> (x / s, s), s = max|x| * (1/448) floored at SCALE_FLOOR: the
    values to store as e4m3 and their dequantisation scale. Also the fused decode kernel's quantiser."""
    s = tl.maximum(tl.max(tl.abs(x)) * INV_MAX, SCALE_FLOOR)
    # div_rn: IEEE division, as torch's; Triton's `/` on float32 is div.full.f32 on CUDA, up to 2 ulp off
    # (triton-lang/triton#10661), which would now and then round a value to a different e4m3 step.
    return tl.math.div_rn(x, s), s


@triton.jit
def _append_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    k_stride_t, k_stride_h, k_stride_d, v_stride_t, v_stride_h, v_stride_d,
    cache_stride_b, cache_stride_s, cache_stride_h, cache_stride_d,
    scale_stride_b, scale_stride_s, scale_stride_h,
    block_size, head_dim,
    BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr, INV_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)  # int64: block * stride overflows int32 in a large pool
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    in_dim = d < head_dim
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + d * k_stride_d, mask=in_dim, other=0.0)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + d * v_stride_d, mask=in_dim, other=0.0)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if QUANTIZE:
        k, k_s = e4m3_scaled(k, INV_MAX, SCALE_FLOOR)
        v, v_s = e4m3_scaled(v, INV_MAX, SCALE_FLOOR)
        scale_offset = block * scale_stride_b + offset * scale_stride_s + head * scale_stride_h
        tl.store(k_scale_ptr + scale_offset, k_s)
        tl.store(v_scale_ptr + scale_offset, v_s)
    cache_offset = block * cache_stride_b + offset * cache_stride_s + head * cache_stride_h + d * cache_stride_d
    tl.store(k_cache_ptr + cache_offset, k.to(k_cache_ptr.dtype.element_ty), mask=in_dim)
    tl.store(v_cache_ptr + cache_offset, v.to(v_cache_ptr.dtype.element_ty), mask=in_dim)


def append_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [T, kv_heads, head_dim] into the caches at slot_mapping [T]; see the module docstring."""
    check_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    quantize = k_cache.dtype == FP8_DTYPE
    # Unused by the non-fp8 kernel (QUANTIZE is a constexpr); any pointer fills the slots.
    scale_k, scale_v = (k_scale, v_scale) if quantize else (k_cache, v_cache)
    scale_strides = k_scale.stride() if quantize else (0, 0, 0)
    _append_kv_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, scale_k, scale_v, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *scale_strides,
        k_cache.shape[1], head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), QUANTIZE=quantize, INV_MAX=INV_FP8_MAX, SCALE_FLOOR=MIN_SCALE,
        num_warps=1,  # one program is one head vector (<= 256 elements in the models here)
        **pdl_arguments(k),
    )


def check_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Shape and dtype mismatches, caught on the host before a kernel writes into the wrong slots."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, kv_heads, head_dim]; got {tuple(k.shape)} and {tuple(v.shape)}.")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] views of one "
                         f"pool, with equal shapes and strides; got {tuple(k_cache.shape)} {k_cache.stride()} and "
                         f"{tuple(v_cache.shape)} {v_cache.stride()}.")
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k has {tuple(k.shape[1:])} (kv_heads, head_dim) per token but the cache holds "
                         f"{tuple(k_cache.shape[2:])}.")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{k.shape[0]}] (one slot per token); got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}.")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"k, v, the caches and slot_mapping must be on one device; got {sorted(map(str, devices))}.")
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(f"k_scale and v_scale are required for a float8_e4m3fn cache and must be None otherwise; "
                         f"the cache is {k_cache.dtype}.")
    if fp8:
        scale_shape = k_cache.shape[:3]
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale.shape != scale_shape or scale.dtype != torch.float32 or scale.device != k_cache.device:
                raise ValueError(f"{name} must be float32 {tuple(scale_shape)} on {k_cache.device} (a scale per "
                                 f"slot and KV head); got {scale.dtype} {tuple(scale.shape)} on {scale.device}.")
        if v_scale.stride() != k_scale.stride():
            raise ValueError(f"k_scale and v_scale must be views of one pool with equal strides; got "
                             f"{k_scale.stride()} and {v_scale.stride()}.")
