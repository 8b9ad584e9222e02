"""Q4_K, Q5_K and Q6_K blocks for test GGUF files.

The `gguf` package reads these k-quant types (`gguf.quants.dequantize`) but cannot write them, and real
files are mostly made of them (Q4_K_M holds Q4_K and Q6_K tensors). These quantizers pack blocks in the
layout that gguf's dequantizer reads; they choose scales by plain min/max, not llama.cpp's error search,
so they are coarser than llama-quantize's, which does not matter for a test: the reference a test compares
against is what gguf dequantizes back from these bytes. `tests/engine/test_gguf.py` checks that the round trip
through gguf's dequantizer lands within one quantization step of the input.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, QK_K


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[n] float32 -> [n, 2] little-endian float16 bytes."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _fit(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes in [0, levels] for non-negative `values` [n, k] on one float16 step per row:
    (step [n] float32, as stored in float16; codes [n, k] uint8)."""
    step = (values.max(axis=-1) / levels).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step[:, None] > 0, np.rint(values / step[:, None]), 0)
    return step, np.clip(codes, 0, levels).astype(np.uint8)


def _scales_and_mins(x: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block of x [n, 8, 32]: 6-bit scale and min codes on two float16 super-steps, and the
    values' codes in [0, top]. Returns (d [n], dmin [n], sc [n, 8], mn [n, 8], q [n, 8, 32])."""
    low = np.minimum(x.min(axis=-1), 0.0)  # [n, 8]: the offset is subtracted, so it must be <= 0
    span = (x.max(axis=-1) - low) / top
    d, sc = _fit(span, 63)
    dmin, mn = _fit(-low, 63)
    scale = d[:, None] * sc  # [n, 8]: what the dequantizer will multiply by
    offset = dmin[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.rint((x + offset[..., None]) / scale[..., None]), 0)
    return d, dmin, sc, mn, np.clip(q, 0, top).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [n, 8] -> the 12 bytes Q4_K and Q5_K store them in [n, 12]."""
    low_sc, high_sc, low_mn, high_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    first = (low_sc & 0x3F) | ((high_sc >> 4) << 6)
    second = (low_mn & 0x3F) | ((high_mn >> 4) << 6)
    third = (high_sc & 0x0F) | ((high_mn & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=-1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Low 4 bits of q [n, 8, 32]: sub-blocks 2g and 2g+1 share 32 bytes (low, high nibble) -> [n, 128]."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _scales_and_mins(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), _nibbles(q)], axis=-1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _scales_and_mins(x, 31)
    high_bits = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]  # bit s: sub-block s
    qh = np.bitwise_or.reduce(high_bits, axis=1)  # [n, 32]
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), qh, _nibbles(q)], axis=-1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    x = rows.reshape(-1, 16, 16).astype(np.float32)  # 16 sub-blocks of 16, one signed 8-bit scale each
    span = np.abs(x).max(axis=-1) / 31  # [n, 16]
    d = (span.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(d[:, None] > 0, np.rint(span / d[:, None]), 0).clip(0, 127)
        step = d[:, None] * scales
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, quarter, 32]
    low, high = q & 0x0F, q >> 4
    # Each 64-byte half of ql holds quarters 0 and 1 in its low nibbles, 2 and 3 in its high ones.
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)


_QUANTIZERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q5_K: quantize_q5_k,
               GGMLQuantizationType.Q6_K: quantize_q6_k}
K_QUANT_TYPES = tuple(_QUANTIZERS)


def quantize_k(weights: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float weights [rows, cols] -> the file's bytes [rows, cols / 256 * block bytes] uint8."""
    rows, cols = weights.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} packs rows in blocks of {QK_K} values; these rows have {cols}.")
    blocks = _QUANTIZERS[qtype](weights.reshape(-1, QK_K))
    return blocks.reshape(rows, cols // QK_K * GGML_QUANT_SIZES[qtype][1])
