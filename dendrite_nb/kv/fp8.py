"""FP8 (e4m3) KV quantisation with one float32 dequantisation scale per token and KV head.

A scale per head vector, rather than per block, lets a block fill token by token: each token is
quantised once, when it is written, and nothing already stored is ever re-quantised.
The Triton append kernel (dendrite_nb.kernels.kv_append) does the same arithmetic in the same order,
so on a GPU both write identical bytes.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# scale = amax * (1/448) rather than amax / 448: torch on CUDA turns a division by a Python scalar into this
# multiplication anyway, so writing it as one keeps CPU, CUDA and the Triton kernel on the same float32 value.
INV_FP8_MAX = 1.0 / FP8_MAX
# Keeps an all-zero vector's scale positive (0 / scale = 0, not NaN). The smallest normal float32, so every
# vector with a magnitude that matters gets exactly amax / 448.
MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (values [..., head_dim] float8_e4m3fn, scales [...] float32).

    Each vector's largest magnitude maps to 448, the top of e4m3's range. With 3 mantissa bits every element
    rounds to within 2^-4 of itself (or 2^-10 of a scale step below e4m3's normal range), and to within half a
    step at the top of the range, 16/448 = amax/28, in absolute terms."""
    x = x.float()
    scales = (x.abs().amax(dim=-1) * INV_FP8_MAX).clamp_min(MIN_SCALE)
    return (x / scales[..., None]).to(FP8_DTYPE), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [..., head_dim] float8_e4m3fn, scales [...] float32 -> float32 [..., head_dim]."""
    return values.float() * scales[..., None]
