"""Write an HF checkpoint folder as one GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

Tests and benchmarks use it to make GGUF files of every family and quantization type from the tiny
checkpoints (nothing can be downloaded here). What it writes follows llama.cpp's converter: the model's
hyperparameters under `{arch}.*`, a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`, tokens,
token types, merges, special ids, chat template, through `gguf.SpecialVocab`), Llama's q/k rows permuted
for llama.cpp's interleaved RoPE, Llama 3's RoPE scaling as a `rope_freqs` tensor, 1-D tensors in F32
and 2-D ones in the asked type. Mistral checkpoints are written as `llama`, as llama.cpp writes them.

`gguf.quants.quantize` writes BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; the k-quants come from `kquants`.
With `dequantized=`, the weights the GGUF decodes to are also written as an HF folder: the exact reference
for a quantized file.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import (MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter,
                  SpecialVocab, TokenType, get_tensor_name_map)
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from dendrite_nb.testing.kquants import K_QUANT_TYPES, quantize_k

# llama.cpp converts Mistral checkpoints with its Llama class: same tensors, same permutation.
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
_ARCH_ENUM = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
_ROPE_FREQS = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"
_NOT_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def write_gguf(checkpoint: str | Path, path: str | Path, qtype: str | GGMLQuantizationType = "F32", *,
               end_of_turn: str | None = None, dequantized: str | Path | None = None) -> Path:
    """Write the HF checkpoint folder `checkpoint` as the GGUF file `path`, its 2-D weights in `qtype`.

    end_of_turn: a token to record as `tokenizer.ggml.eot_token_id` (e.g. "<|eot_id|>"), as chat GGUFs do.
    dequantized: a folder to write the checkpoint's config and tokenizer into, with the weights the GGUF's
    weights dequantize to (HF names and layout).
    """
    folder, path = Path(checkpoint), Path(path)
    qtype = qtype if isinstance(qtype, GGMLQuantizationType) else GGMLQuantizationType[qtype]
    config = json.loads((folder / "config.json").read_text())
    arch = _GGUF_ARCH[config["model_type"]]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    writer.add_name(folder.name)
    _add_hyperparameters(writer, config, arch)
    _add_vocabulary(writer, folder, config["vocab_size"], end_of_turn)
    name_map = get_tensor_name_map(_ARCH_ENUM[arch], config["num_hidden_layers"])
    reference: dict[str, torch.Tensor] = {}
    for hf_name, tensor in tensors.items():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{hf_name} in {folder} has no GGUF name for arch {arch!r}.")
        values = tensor.float().numpy()
        stored, stored_type, decoded = _encode(values, qtype if values.ndim == 2 else GGMLQuantizationType.F32)
        reference[hf_name] = torch.from_numpy(decoded)
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            # Blocks run along a row and the permutation moves whole rows, so permuting the encoded rows
            # equals encoding the permuted weight.
            heads = config["num_attention_heads"] if ".attn_q." in gguf_name else config["num_key_value_heads"]
            stored = _permute(stored, heads)
        writer.add_tensor(gguf_name, stored, raw_dtype=stored_type)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(_ROPE_FREQS, _llama3_rope_factors(config, rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if dequantized is not None:
        _write_reference(folder, Path(dequantized), reference)
    return path


def _add_hyperparameters(writer: GGUFWriter, config: dict, arch: str) -> None:
    """The keys llama.cpp's TextModel.set_gguf_parameters and its Llama / Phi-3 classes write."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
    if arch == "phi3" and config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])


def _add_vocabulary(writer: GGUFWriter, folder: Path, vocab_size: int, end_of_turn: str | None) -> None:
    """Tokens and their types as llama.cpp's get_vocab_base lists them; merges, special ids, add_bos and the
    chat template through gguf's SpecialVocab, which reads them from the folder's tokenizer files."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):  # a padded embedding has rows with no token: llama.cpp names them [PADn]
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the tiny tokenizers split text with GPT-2's byte-level regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    if end_of_turn is not None:
        writer.add_eot_token_id(tokenizer.convert_tokens_to_ids(end_of_turn))


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType | None,
                                                                      np.ndarray]:
    """(what the file stores, its raw type for the writer or None for plain floats, what it decodes to)."""
    if qtype == GGMLQuantizationType.F32:
        return values, None, values
    if qtype == GGMLQuantizationType.F16:
        half = values.astype(np.float16)
        return half, None, half.astype(np.float32)
    blocks = quantize_k(values, qtype) if qtype in K_QUANT_TYPES else quantize(values, qtype)
    return blocks, qtype, dequantize(blocks, qtype)


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of q (heads) or k (kv heads) rows: each head's rotary halves
    interleaved, for llama.cpp's pairwise RoPE."""
    return (rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2)
            .reshape(rows.shape))


def _llama3_rope_factors(config: dict, rope: dict) -> np.ndarray:
    """The divisors of each RoPE frequency that llama.cpp stores for Llama 3 scaling (its formula, verbatim)."""
    base = rope.get("rope_theta", config.get("rope_theta"))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_reference(folder: Path, target: Path, tensors: dict[str, torch.Tensor]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for file in folder.iterdir():
        if file.is_file() and file.name not in _NOT_WEIGHTS and not file.name.endswith(".safetensors"):
            shutil.copy2(file, target / file.name)
    save_file(tensors, target / "model.safetensors")
