"""RMSNorm, and the residual add fused into it: one read and one write of the hidden states instead of three.

Rounding follows transformer.RMSNorm: the residual sum is rounded to the activation dtype (the reference adds in
that dtype), the normalisation runs in float32 and is rounded before the weight multiplies it, and the product is
rounded again. Arithmetic is spelled out in float32 with explicit casts, so bf16 results match torch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_arguments, wait_for_inputs


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
                     x_stride, residual_stride, out_stride, sum_stride, dim, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prefills at large hidden sizes
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)
        tl.store(sum_ptr + row * sum_stride + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (weight * normed).to(dtype), mask=mask)


def _check_like(name: str, tensor: torch.Tensor, x: torch.Tensor) -> None:
    if tensor.shape != x.shape or tensor.dtype != x.dtype or tensor.stride(-1) != 1:
        raise ValueError(f"{name} is {tuple(tensor.shape)} {tensor.dtype} with strides {tensor.stride()}; expected "
                         f"{tuple(x.shape)} {x.dtype} with contiguous rows, like x.")


def _launch(x, residual, weight, eps, out, summed) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, dim] with contiguous rows, got shape {tuple(x.shape)} and strides "
                         f"{x.stride()}; flatten the leading dims first.")
    tokens, dim = x.shape
    if weight.shape != (dim,) or weight.dtype != x.dtype:
        raise ValueError(f"weight is {tuple(weight.shape)} {weight.dtype}; expected ({dim},) {x.dtype}, "
                         f"matching x [T, {dim}].")
    block = triton.next_power_of_2(dim)
    has_residual = residual is not None
    _rms_norm_kernel[(tokens,)](
        x, residual if has_residual else x, weight, out, summed if has_residual else out,
        x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0),
        summed.stride(0) if has_residual else 0, dim, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=min(max(block // 256, 1), 8), **pdl_arguments(x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rmsnorm(x) for x [T, dim] -> [T, dim] in x's dtype (written into `out` when given)."""
    out = torch.empty_like(x) if out is None else out
    _check_like("out", out, x)
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, dim] -> (weight * rmsnorm(x + residual), x + residual), both [T, dim] in x's dtype.

    The second result is the new residual stream; `out` = (normed, summed) receives them when given. With no
    residual (a first layer), x itself is the stream: (rms_norm(x), x), as gemv's and skinny's folds take it.
    """
    if residual is None:
        return rms_norm(x, weight, eps, out=None if out is None else out[0]), x
    _check_like("residual", residual, x)
    normed, summed = (torch.empty_like(x), torch.empty_like(x)) if out is None else out
    _check_like("out[0]", normed, x)
    _check_like("out[1]", summed, x)
    _launch(x, residual, weight, eps, normed, summed)
    return normed, summed
