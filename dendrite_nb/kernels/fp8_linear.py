"""Products with fp8 weights where the model's own kernels do not run them (prefill, large batches, eager GPU
steps: products.py), and the check that every fp8 product makes of its weight.

An fp8 weight is float8_e4m3fn [N, K] with a float32 scale per output channel [N]: W = scale[:, None] * W8.
Every path applies the scale to the float32 result of x @ W8.T, column by column, before the bias and the
cast to x's dtype; it is the same product, rounded once.

On a CUDA GPU with e4m3 tensor cores (compute capability 8.9 and later: Ada, Hopper, Blackwell), through
torch._scaled_mm with row-wise scales: x is quantised per row to e4m3 on the fly (row_quantize.py, one launch,
the arithmetic of kv/fp8.quantize: each row's largest magnitude maps to 448), its scale [M, 1] and the weight's
[1, N] apply in the library's epilogue. Why the library here and our kernels for decode steps: at hundreds of rows a product is bound by
tensor-core time, and fp8 tensor cores run at twice bf16's rate on tiles cuBLASLt (or CUTLASS) has tuned for
such shapes; at the few rows of a decode step it is bound by the weight's bytes, which gemv.py and skinny.py
read as fp8 (half of bf16's), keeping x at full precision, where they already beat cuBLAS (products.py).
Measured on an H200 (benchmarks/fp8_products.py): at 1-16 rows our kernels beat this path on every 0.6B and
8B projection and LM head but the 8B gate/up at 4 and 16 rows; at 512 rows this path beat bf16 cuBLAS on the
8B gate/up and the LM heads (1.2-1.7x) and lost elsewhere (0.2-0.63x). x's quantisation was then seven small
eager kernels (cast, abs, amax, scale, clamp, divide, cast), and the path cost about 20 us even where the
product itself is 2 (0.6B o_proj at one row: 22 us), which a small product does not earn back (at 512 rows
33 us against bf16's 7); row_quantize.py now does it in one launch. Quantising x costs
accuracy too: 2-5% of an output row on random data, where the weight's e4m3 alone costs a fraction of a percent.

Elsewhere (the CPU, older GPUs, widths cuBLASLt refuses: K or N not a multiple of 16), the weight is widened
to float32 a chunk of output rows at a time (at most DEQUANTIZED_CHUNK_BYTES of it at once) and F.linear
runs in float32.
"""
from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from ..kv.fp8 import FP8_DTYPE, quantize
from .row_quantize import row_quantize

E4M3_CAPABILITY = (8, 9)  # the first GPUs with e4m3 in hardware: Triton's fp8e4nv and _scaled_mm need them
SCALED_MM_MULTIPLE = 16  # cuBLASLt's fp8 products need K and N to be multiples of it
DEQUANTIZED_CHUNK_BYTES = 64 << 20  # the float32 weight rows the fallback widens at once


def check_weight_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """Raise ValueError unless weight and weight_scale make a product: an fp8 weight [N, K] with a contiguous
    float32 scale [N] on its device, or a weight of another dtype without a scale."""
    if weight_scale is None:
        if weight.dtype == FP8_DTYPE:
            raise ValueError(f"the weight {tuple(weight.shape)} is {FP8_DTYPE} but no weight_scale was given; pass "
                             f"its float32 scale per output channel, weight_scale [{weight.shape[0]}].")
        return
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"a weight_scale was given, so the weight must be {FP8_DTYPE} [N, K]; got "
                         f"{weight.dtype} {tuple(weight.shape)}. Quantise it first, or pass weight_scale=None.")
    if (weight_scale.dtype != torch.float32 or weight_scale.shape != weight.shape[:1]
            or weight_scale.device != weight.device or weight_scale.stride(0) != 1):
        raise ValueError(f"weight_scale is {weight_scale.dtype} {tuple(weight_scale.shape)} on "
                         f"{weight_scale.device} (stride {weight_scale.stride()}); expected a contiguous float32 "
                         f"[{weight.shape[0]}] on {weight.device}: one scale per output channel (row) of the weight.")


@functools.lru_cache(maxsize=None)
def has_e4m3(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU with e4m3 in hardware (compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= E4M3_CAPABILITY


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight_scale[:, None] * weight.float()).T (+ bias) -> [..., N] in x's dtype, for an fp8
    weight [N, K] and its float32 scale [N]: through torch._scaled_mm on a GPU with e4m3 tensor cores, else
    through a float32 F.linear of the weight widened chunk by chunk."""
    check_weight_scale(weight, weight_scale)
    if weight_scale is None:
        raise ValueError(f"fp8_linear multiplies by fp8 weights; this one is {weight.dtype}: use F.linear.")
    out_features, width = weight.shape
    if x.shape[-1] != width:
        raise ValueError(f"x has {x.shape[-1]} features per row but the weight {tuple(weight.shape)} takes {width}.")
    rows = x.reshape(-1, width)
    if (has_e4m3(x.device) and weight.is_contiguous() and width % SCALED_MM_MULTIPLE == 0
            and out_features % SCALED_MM_MULTIPLE == 0):
        y = scaled_mm_linear(rows, weight, weight_scale, bias)
    else:
        y = dequantized_linear(rows, weight, weight_scale, bias)
    return y.view(*x.shape[:-1], out_features)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantised weight.T through torch._scaled_mm with row-wise scales, x quantised per row to
    e4m3; float32 accumulation, the result in x's dtype. The library takes a bias only in a 16-bit dtype equal
    to the output's: a float32 product adds its bias afterwards."""
    # [M, K] e4m3, [M] float32; the same values either way (torch's CPU _scaled_mm serves the tests).
    x8, x_scale = row_quantize(x) if x.is_cuda else quantize(x)
    fused_bias = bias is not None and x.dtype in (torch.bfloat16, torch.float16) and bias.dtype == x.dtype
    # weight.t(): [K, N] column-major, the layout cuBLASLt's fp8 products take for their second operand.
    y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :],
                         bias=bias if fused_bias else None, out_dtype=x.dtype)
    if bias is not None and not fused_bias:
        y = (y.float() + bias.float()).to(x.dtype)
    return y


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight_scale[:, None] * weight.float()).T (+ bias) in float32, cast to x's dtype once; the
    weight widened to float32 at most DEQUANTIZED_CHUNK_BYTES of rows at a time."""
    out_features, width = weight.shape
    x32 = x.float()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    chunk_rows = max(1, DEQUANTIZED_CHUNK_BYTES // (4 * width))
    for start in range(0, out_features, chunk_rows):
        stop = min(out_features, start + chunk_rows)
        torch.mul(F.linear(x32, weight[start:stop].float()), weight_scale[start:stop], out=y[:, start:stop])
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
