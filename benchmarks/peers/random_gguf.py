"""A GGUF file of the engine's own in-memory model: the very tensors a benchmark's random real-shape model holds
(bench_common.build_model), so that llama.cpp runs the same weights as the engine on a machine that cannot download
a checkpoint.

What is written follows llama.cpp's converter for the model's family (Qwen3 as "qwen3", Llama as "llama"):
  - hyperparameters from the engine's ModelConfig under `{arch}.*`, and Llama 3's RoPE scaling as a `rope_freqs`
    tensor (the divisor of each frequency);
  - every parameter under its GGUF name (gguf's tensor-name map), 2-D tensors in the asked type (f32, f16 or bf16;
    bf16 -> f16 is exact for these weights, whose magnitudes sit well inside f16's normal range), 1-D ones
    (the norms) in F32; a tied embedding is written once, as token_embd (llama.cpp then reads it as the LM head);
  - Llama's q/k rows permuted for llama.cpp's interleaved RoPE (testing/gguf_writer.py's permutation). Qwen3 runs
    the rotate-half RoPE the engine runs (llama.cpp's NEOX type): its rows stay as they are;
  - a made-up vocabulary of the model's size: token i is the text "<t{i}>", a SentencePiece ("llama") vocabulary
    with no merges to learn, the model's bos/eos ids marked as control tokens, no BOS added. The benchmarks feed
    token ids to both systems, so the texts never matter; they only make the file one llama.cpp accepts.

    write_random_gguf(model, path, "f16")                  the file; returns path
    python -m peers.random_gguf --shape qwen3-0.6b ...     (from benchmarks/) the same for a benchmark's model
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType, get_tensor_name_map

from dendrite_nb.model.config import ModelConfig
from dendrite_nb.model.rope import rope_inv_freq
from dendrite_nb.model.transformer import CausalLM
from dendrite_nb.testing.gguf_writer import _permute as permute_for_interleaved_rope

_T = GGMLQuantizationType
WEIGHT_TYPES = {"f32": (_T.F32, LlamaFileType.ALL_F32), "f16": (_T.F16, LlamaFileType.MOSTLY_F16),
                "bf16": (_T.BF16, LlamaFileType.MOSTLY_BF16)}
# The engine's model_type -> llama.cpp's architecture (Mistral is written as Llama, as llama.cpp's converter does).
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}
_ARCH_ENUM = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}


class RandomGGUFError(ValueError):
    """The model cannot be written as a GGUF here; the message says why and what to pick instead."""


def token_text(index: int) -> str:
    return f"<t{index}>"


def write_random_gguf(model: CausalLM, path: str | Path, weight_type: str = "f16") -> Path:
    """Write `model`'s weights and shape as the GGUF file `path` (2-D tensors in `weight_type`)."""
    config = model.config
    if weight_type not in WEIGHT_TYPES:
        raise RandomGGUFError(f"weight type {weight_type!r} is not one of {sorted(WEIGHT_TYPES)}.")
    if config.model_type not in GGUF_ARCH:
        raise RandomGGUFError(f"model_type {config.model_type!r} has no GGUF writer here; write one of "
                              f"{sorted(GGUF_ARCH)}.")
    if model.weights_format is not None:
        raise RandomGGUFError(f"the model's weights are quantized ({model.weights_format}); write the GGUF from the "
                              f"float model before quantize_model.")
    if config.qkv_bias or config.o_bias or config.mlp_bias or config.sliding_window is not None:
        raise RandomGGUFError(f"{config.describe()} has biases or a sliding window, which this writer leaves out; "
                              f"use a shape without them (the real shapes have none).")
    arch = GGUF_ARCH[config.model_type]
    qtype, file_type = WEIGHT_TYPES[weight_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")   # renamed only when whole: a killed run leaves no half file behind
    writer = GGUFWriter(partial, arch)
    writer.add_name(f"dendrite-nb random {config.describe()}")
    writer.add_file_type(int(file_type))
    _add_hyperparameters(writer, config, arch)
    _add_vocabulary(writer, config)
    name_map = get_tensor_name_map(_ARCH_ENUM[arch], config.num_layers)
    for name, param in model.named_parameters():   # a tied LM head is the embedding's parameter: listed once
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise RandomGGUFError(f"parameter {name} has no GGUF name for arch {arch!r}.")
        stored, stored_type = _encode(param.detach(), qtype if param.dim() == 2 else _T.F32)
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = config.num_heads if ".attn_q." in gguf_name else config.num_kv_heads
            stored = permute_for_interleaved_rope(stored, heads)
        writer.add_tensor(gguf_name, stored, raw_dtype=stored_type)
    factors = _rope_divisors(config)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def _add_hyperparameters(writer: GGUFWriter, config: ModelConfig, arch: str) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_vocab_size(config.vocab_size)


def _add_vocabulary(writer: GGUFWriter, config: ModelConfig) -> None:
    special = {i for i in (config.bos_token_id, *config.eos_token_ids) if i is not None and i < config.vocab_size}
    writer.add_tokenizer_model("llama")
    writer.add_token_list([token_text(i) for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(config.vocab_size)])
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)


def _encode(param: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """(what the file stores, its type), in torch's row order ([out, in], as GGUF stores it)."""
    if qtype == _T.BF16:
        # numpy has no bfloat16: the file takes its 16-bit patterns as they are.
        return param.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16), _T.BF16
    dtype = torch.float16 if qtype == _T.F16 else torch.float32
    return np.ascontiguousarray(param.to(dtype).cpu().numpy()), qtype


def _rope_divisors(config: ModelConfig) -> np.ndarray | None:
    """Llama 3 scaling as llama.cpp stores it: each RoPE frequency's divisor (plain over scaled)."""
    if config.rope_scaling is None and config.rope_factors is None:
        return None
    plain = rope_inv_freq(dataclasses.replace(config, rope_scaling=None, rope_factors=None), "cpu")
    return (plain / rope_inv_freq(config, "cpu")).numpy().astype(np.float32)


def main(argv: list[str] | None = None) -> Path:
    from bench_common import Setup, build_model, log

    from dendrite_nb.testing import REAL_SHAPES

    arguments = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_argument("--shape", choices=sorted(REAL_SHAPES), default="qwen3-0.6b")
    arguments.add_argument("--smoke", action="store_true", help="the tiny shape standing in for it (bench_common)")
    arguments.add_argument("--device", default=None, help="where the model is built (default: cuda when available): "
                                                          "the same device and seed give the same weights")
    arguments.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                           help="the model's dtype (default: bfloat16 on cuda, float32 elsewhere)")
    arguments.add_argument("--type", dest="weight_type", choices=sorted(WEIGHT_TYPES), default="f16")
    arguments.add_argument("--seed", type=int, default=0)
    arguments.add_argument("--out", type=Path, required=True)
    args = arguments.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    setup = Setup(device, dtype, args.smoke)
    model = build_model(setup, setup.hf_config(args.shape), seed=args.seed)
    path = write_random_gguf(model, args.out, args.weight_type)
    log(f"wrote {path} ({path.stat().st_size / 1e6:,.1f} MB): {model.config.describe()}, {args.weight_type}")
    return path


if __name__ == "__main__":
    main()
