"""Weight quantizers: a float weight [out_features, in_features] -> the integers and scales a quantized product reads.

Three formats, each weight-only (activations keep the model's dtype):
- int8: symmetric, one float32 scale per output channel: W ~ scale[:, None] * q, q in [-127, 127].
- int4: asymmetric, one (scale, zero) per group of INT4_GROUP inputs of an output channel: W ~ (q - 8) * scale +
  zero, q in [0, 15]. torch's packed int4 products take this form. GGUF's 4-bit formats (Q4_0, Q4_1, Q4_K) store
  groups of 32 inputs too, each an affine map of 16 levels, so a group whose levels span 0..15 maps onto int4's
  with no new rounding.
- fp8: float8 e4m3 with one float32 scale per output channel: W ~ scale[:, None] * w8, scaled so that each
  channel's largest magnitude lands on e4m3's largest finite value (448).

Each quantizer works on any device, in float32 whatever the weight's dtype, and returns tensors on that device.
"""
from __future__ import annotations

import torch

INT4_GROUP = 32  # inputs per int4 group: GGUF's block width, and a group size torch's int4 products take
INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A channel (or group) of zeros still needs a nonzero scale to divide by; any will do, its integers are all 0.
_TINY_SCALE = torch.finfo(torch.float32).tiny


def channel_absmax(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N]: each output channel's largest magnitude, what int8's and fp8's scales come from."""
    return weight.float().abs().amax(dim=1)


def quantize_int8(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]). absmax: the channels' largest magnitudes to scale by
    instead of this weight's own (a tensor-parallel rank's part of a weight split by inputs takes the whole
    weight's, so its integers equal those of the whole weight's quantization)."""
    w = weight.float()
    scale = ((channel_absmax(w) if absmax is None else absmax) / INT8_MAX).clamp_min(_TINY_SCALE)
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K a multiple of `group`) -> (q uint8 [N, K] holding 0..15, scale float32 [N, K // group],
    zero float32 [N, K // group]), W ~ (q - 8) * scale + zero per group: each group's min and max are its
    levels 0 and 15."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"int4 groups are {group} inputs wide; this weight has {in_features} inputs.")
    w = weight.float().reshape(out_features, in_features // group, group)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale = ((high - low) / 15).clamp_min(_TINY_SCALE)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scale, low + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [N, K], scale and zero [N, K // group]) -> W [N, K] in `dtype`."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    w = (q.reshape(out_features, groups, -1).to(torch.float32) - 8) * scale[..., None] + zero[..., None]
    return w.reshape(out_features, in_features).to(dtype)


def quantize_fp8(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (w8 float8_e4m3fn [N, K], scale float32 [N]). absmax: as quantize_int8's."""
    w = weight.float()
    scale = ((channel_absmax(w) if absmax is None else absmax) / FP8_MAX).clamp_min(_TINY_SCALE)
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (w8.to(torch.float32) * scale[:, None]).to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] of 0..15 -> [N, K // 2], input 2j in the low nibble of byte j and 2j + 1 in the high one."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: [N, K // 2] -> [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(packed.shape[0], -1)
