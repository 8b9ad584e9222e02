"""Rows of activations to e4m3 in one launch: x [M, K] -> (x8 [M, K] float8_e4m3fn, scales [M] float32), each
row's largest magnitude mapped to 448, the same arithmetic as kv/fp8.quantize (scale = amax * (1/448), kept
above float32's smallest normal; x / scale rounded to nearest even), which takes seven torch launches (cast, abs,
amax, scale, clamp, divide, cast).

Why a kernel: torch._scaled_mm multiplies e4m3 by e4m3, so an fp8-weight product through it quantises x first
(fp8_linear.py). Inside a decode graph of an 8B model at 64 leaves that is 128 products a step, and seven
kernels of a few microseconds each per product cost more than reading half the weight bytes saves. One program
a row: it reads the row twice (its largest magnitude, then the quantised values), the second time from L2.

The division is IEEE round-to-nearest (div_rn), as torch divides, so both give the same bytes; where the quotient
rounds above 448 (amax / (amax * (1/448)) can), e4m3's conversion saturates to 448 here, where torch's cast would
give NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv.fp8 import FP8_DTYPE, INV_FP8_MAX, MIN_SCALE

BLOCK_K = 2048  # elements of a row per iteration: one 4 KB bf16 read per program and step
NUM_WARPS = 4


@triton.jit
def _row_quantize_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om, inv_fp8_max, min_scale,
                         BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    out_row = out_ptr + row * stride_om
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        # Clamped to e4m3's range first: the interpreter's cast wraps where the GPU's saturates.
        quantized = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        tl.store(out_row + k, quantized.to(out_ptr.dtype.element_ty), mask=k < K)


def row_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous rows, any float dtype) -> (x8 [M, K] float8_e4m3fn, scales [M] float32), as
    kv/fp8.quantize(x) computes them, in one launch."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"row_quantize takes x [M, K] with contiguous rows; got {tuple(x.shape)} with strides "
                         f"{x.stride()}.")
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _row_quantize_kernel[(rows,)](x, out, scales, width, x.stride(0), out.stride(0), INV_FP8_MAX, MIN_SCALE,
                                      BLOCK_K=min(BLOCK_K, triton.next_power_of_2(width)), num_warps=NUM_WARPS)
    return out, scales
