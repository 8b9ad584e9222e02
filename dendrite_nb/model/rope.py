"""Rotary position embeddings: plain and Llama 3 frequency scaling (as parameters, or as a GGUF's per-frequency
divisors), laid out as in HF (rotate_half)."""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2]."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_factors is not None:
        return inv_freq / torch.tensor(config.rope_factors, dtype=torch.float32, device=device)
    if config.rope_scaling is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend the band in between.
    scaling = config.rope_scaling
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for token positions [T]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
