"""Fused Triton kernels for the decoder's memory-bound steps: RMSNorm (+ residual add), RoPE on q and k, SwiGLU,
and the matrix products of decode steps of a few rows (gemv for one, skinny for up to 16; products.py picks).

Each reproduces the rounding of the torch reference in dendrite_nb.model (float32 math, cast to the activation
dtype wherever the reference casts), so bf16 results match it. Importing this package imports triton. The
kernels take CUDA tensors; CPU tensors only run when TRITON_INTERPRET=1 was set before this import (the Triton
interpreter: slow, and wrong in bfloat16, so for float32 tests only).
"""
from __future__ import annotations

import torch

from .gemv import gemv
from .norm import add_rms_norm, rms_norm
from .pdl import INTERPRETED
from .products import linear, linear_silu_mul, norm_linear, product_kernel
from .rope import rope_qk
from .skinny import skinny
from .swiglu import silu_mul


def unavailable_reason(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on tensors of `device`, or None when they can."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
        return None
    return (f"they are Triton GPU kernels and the model is on {device.type}; run it on CUDA (on the CPU they "
            f"only run under the Triton interpreter, TRITON_INTERPRET=1 set before dendrite_nb.kernels is "
            f"imported, which is for tests)")


__all__ = ["INTERPRETED", "add_rms_norm", "gemv", "linear", "linear_silu_mul", "norm_linear", "product_kernel",
           "rms_norm", "rope_qk", "silu_mul", "skinny", "unavailable_reason"]
