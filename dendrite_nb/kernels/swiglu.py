"""SwiGLU, silu(gate) * up, read from the one [T, 2 * intermediate] output of the fused gate_up projection.

Rounding follows MLP.forward: silu is computed in float32 and rounded to the activation dtype (as F.silu does),
then the product with up is rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_arguments, wait_for_inputs

MAX_BLOCK = 1024  # columns per program: wide rows (intermediate 14,336) split across programs


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32, rounded as MLP.forward rounds: gate and up as the activation dtype holds them,
    silu rounded to it (as F.silu returns it). The folded GEMV and few-row products end with this too."""
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return silu * up.to(dtype).to(tl.float32)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, in_stride, out_stride, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    src = gate_up_ptr + row * in_stride + cols
    gate = tl.load(src, mask=mask, other=0.0)
    up = tl.load(src + width, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, silu_times_up(gate, up, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate in the first I columns, up in the last) -> silu(gate) * up [T, I].

    Written into `out` [T, I] when given.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * intermediate] with contiguous rows, got shape "
                         f"{tuple(gate_up.shape)} and strides {gate_up.stride()}.")
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = gate_up.new_empty(tokens, width)
    elif out.shape != (tokens, width) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} with strides {out.stride()}; expected "
                         f"[{tokens}, {width}] {gate_up.dtype} with contiguous rows.")
    block = min(MAX_BLOCK, triton.next_power_of_2(width))
    _silu_mul_kernel[(tokens, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block, num_warps=4, **pdl_arguments(gate_up))
    return out
