"""The model's shape from a GGUF file's metadata: llama.cpp's `{arch}.*` keys, read into a ModelConfig.

The keys are spelled as an HF config.json would spell them, so that ModelConfig.from_hf checks a GGUF as it
checks any checkpoint; what GGUF states by tensors instead of keys is added after: whether there are biases,
whether the embedding is tied (no output.weight), and Llama 3's RoPE scaling (a rope_freqs tensor of
per-frequency divisors). End tokens are the metadata's eos, eot (end of turn) and eom (end of message) ids.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFReader, Keys

from ..errors import CheckpointError, UnsupportedModel
from .config import ModelConfig

# GGUF architecture -> the engine's model_type. llama.cpp writes Mistral (and SmolLM2, and most Llama-shaped
# models) as "llama"; it has no plain "mistral" architecture.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
ROPE_FREQS = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"  # Llama 3 scaling, as per-frequency divisors
_LONG_ROPE = tuple(TENSOR_NAMES[t] + ".weight"
                   for t in (MODEL_TENSOR.ROPE_FACTORS_LONG, MODEL_TENSOR.ROPE_FACTORS_SHORT))
# Metadata ids that end generation: end of text, of turn, of message (llama.cpp reads the same three).
_END_TOKEN_KEYS = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
_REQUIRED = object()


def gguf_config(reader: GGUFReader, path: Path, arch: str, names: dict[str, Any]) -> ModelConfig:
    """The ModelConfig that the metadata and the tensor table (`names`: GGUF name -> gguf's ReaderTensor)
    of the `arch` file at `path` describe."""
    key = lambda template: template.format(arch=arch)  # noqa: E731
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{str(path)!r} has no token_embd.weight tensor (the token embeddings).")
    vocab_size, hidden = torch_shape(names["token_embd.weight"])
    heads = _count(reader, key(Keys.Attention.HEAD_COUNT), path)
    if heads == 0:
        raise CheckpointError(f"{str(path)!r} has {key(Keys.Attention.HEAD_COUNT)} = 0.")
    head_dim = _count(reader, key(Keys.Attention.KEY_LENGTH), path, hidden // heads)
    value_dim = _count(reader, key(Keys.Attention.VALUE_LENGTH), path, head_dim)
    rotary_dims = _count(reader, key(Keys.Rope.DIMENSION_COUNT), path, head_dim)
    if value_dim != head_dim or rotary_dims != head_dim:
        raise UnsupportedModel(f"{str(path)!r} has heads of {head_dim} key, {value_dim} value and {rotary_dims} "
                               f"rotary dimensions; dendrite-nb needs them equal (RoPE over whole heads).")
    scaling = field(reader, key(Keys.Rope.SCALING_TYPE), path, "none")
    if scaling != "none":
        raise UnsupportedModel(f"{str(path)!r} uses RoPE scaling {scaling!r}; dendrite-nb runs plain RoPE and "
                               f"Llama 3's scaling (a rope_freqs tensor).")
    long_rope = [name for name in _LONG_ROPE if name in names]
    if long_rope:
        raise UnsupportedModel(f"{str(path)!r} carries {', '.join(long_rope)} (Phi-3's LongRoPE for long "
                               f"contexts), which dendrite-nb does not run; use a 4k-context Phi-3 GGUF.")
    end_ids = [_count(reader, k, path, None) for k in _END_TOKEN_KEYS]
    raw = {
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": vocab_size,
        "hidden_size": _count(reader, key(Keys.LLM.EMBEDDING_LENGTH), path),
        "intermediate_size": _count(reader, key(Keys.LLM.FEED_FORWARD_LENGTH), path),
        "num_hidden_layers": _count(reader, key(Keys.LLM.BLOCK_COUNT), path),
        "num_attention_heads": heads,
        "num_key_value_heads": _count(reader, key(Keys.Attention.HEAD_COUNT_KV), path, heads),
        "head_dim": head_dim,
        "rms_norm_eps": _number(reader, key(Keys.Attention.LAYERNORM_RMS_EPS), path),
        "rope_theta": _number(reader, key(Keys.Rope.FREQ_BASE), path, 10000.0),
        "max_position_embeddings": _count(reader, key(Keys.LLM.CONTEXT_LENGTH), path),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _count(reader, Keys.Tokenizer.BOS_ID, path, None),
        "eos_token_id": list(dict.fromkeys(i for i in end_ids if i is not None)),
        "sliding_window": _count(reader, key(Keys.Attention.SLIDING_WINDOW), path, None),
    }
    config = ModelConfig.from_hf(raw)
    if config.hidden_size != hidden:
        raise CheckpointError(f"{str(path)!r}: token_embd.weight has {hidden} columns, "
                              f"{key(Keys.LLM.EMBEDDING_LENGTH)} says {config.hidden_size}.")
    return dataclasses.replace(
        config,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        rope_factors=_rope_factors(names.get(ROPE_FREQS), config.head_dim, path),
    )


def _rope_factors(tensor: Any, head_dim: int, path: Path) -> tuple[float, ...] | None:
    if tensor is None:
        return None
    if tensor.tensor_type != GGMLQuantizationType.F32 or torch_shape(tensor) != (head_dim // 2,):
        raise CheckpointError(f"{str(path)!r}: {ROPE_FREQS} is {tensor.tensor_type.name} {torch_shape(tensor)}, "
                              f"expected F32 ({head_dim // 2},), one divisor per RoPE frequency.")
    return tuple(float(v) for v in np.asarray(tensor.data, dtype=np.float32))


def torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dimension first


def field(reader: GGUFReader, key: str, path: Path, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{str(path)!r} has no {key!r} in its metadata, which a GGUF of this model needs; "
                                  f"the file is incomplete, or was written by a converter that left it out.")
        return default
    return field.contents()


def text(reader: GGUFReader, key: str, path: Path) -> str:
    value = field(reader, key, path)
    if not isinstance(value, str):
        raise CheckpointError(f"{str(path)!r} has {key} = {value!r}, expected a string.")
    return value


def _count(reader: GGUFReader, key: str, path: Path, default: Any = _REQUIRED) -> Any:
    value = field(reader, key, path, default)
    if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise UnsupportedModel(f"{str(path)!r} has {key} = {value!r}; dendrite-nb needs one non-negative integer "
                               f"(per-layer values are not supported).")
    return value


def _number(reader: GGUFReader, key: str, path: Path, default: Any = _REQUIRED) -> float:
    value = field(reader, key, path, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"{str(path)!r} has {key} = {value!r}, expected a positive number.")
    return float(value)
