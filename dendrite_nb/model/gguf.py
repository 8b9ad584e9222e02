"""Read a GGUF file (llama.cpp's format) into the engine's model and tokenizer.

`Engine.from_pretrained` takes a `.gguf` file, or a folder that holds exactly one `.gguf` and no HF weights (a
folder with config.json and safetensors weights is an HF checkpoint, whatever else it holds). The file is read with the `gguf`
package's memory-mapped GGUFReader; the model's shape comes from the metadata (gguf_config.py). Each tensor
is dequantized on its own (`gguf.quants.dequantize`) and copied into the engine's preallocated parameter, in
the engine's dtype, so a load holds at most one float32 tensor beside the model. Tensor names come from
gguf's tensor-name map; llama.cpp permutes Llama's q/k rows for its interleaved RoPE, and transformers' GGUF
tensor processor undoes that. The tokenizer and chat template come from the metadata, through transformers
(gguf_tokenizer.py).

Everything is checked before anything is built: the architecture, every tensor's type, the hyperparameters,
and every tensor's name and shape against the model they describe. A bad file raises a CheckpointError (an
UnsupportedModel for an architecture or type the engine does not run) and nothing is loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, Keys, get_tensor_name_map
from gguf.quants import dequantize
from tqdm.std import tqdm  # the text bar: dendrite_nb imports no notebook code

from ..errors import CheckpointError, UnsupportedModel
from . import loader
from .config import ModelConfig
from .gguf_config import ROPE_FREQS, SUPPORTED_ARCHITECTURES, field, gguf_config, text, torch_shape
from .gguf_tokenizer import gguf_tokenizer
from .transformer import CausalLM

GGUF_MAGIC = b"GGUF"
_T = GGMLQuantizationType
# Q5_0 and Q5_1 are here because llama-quantize falls back to them in Q4_K_M / Q5_K_M files for tensors whose
# rows are not a multiple of 256 (SmolLM2's 576, Qwen2.5-0.5B's 896).
SUPPORTED_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q4_K, _T.Q5_K, _T.Q6_K)
_ARCH_ENUM = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
# Quantized types above 4 bits: a file that stores a tensor this way (Q4_K_M keeps the LM head and some
# projections in Q6_K or Q8_0) says it needs more than 4 bits, so weights="int4" keeps it in int8.
ABOVE_4_BITS = (_T.Q8_0, _T.Q5_0, _T.Q5_1, _T.Q5_K, _T.Q6_K)


class GGUFCheckpoint(NamedTuple):
    """A GGUF file read and checked, before any weight is loaded."""

    path: Path
    reader: GGUFReader  # memory-mapped; tensor data is read only when a tensor is dequantized
    arch: str
    config: ModelConfig
    plan: dict[str, tuple[str, ...]]  # GGUF tensor -> the model parameters it fills (several when fused)
    metadata: memoryview  # the bytes before the tensor table: what the tokenizer is built from
    num_tokens: int  # entries in the file's token list


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map (the same bytes, still mapped): numpy.memmap's
    __array_finalize__ runs on every slice the reader takes, about 250,000 for a real vocabulary's metadata and
    then every dequantizer's view of a tensor. The demo model's file: 1.4 against 4.2 s, the same fields and
    tensors."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._data = mapped.view(np.ndarray)


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one `.gguf` in a folder that is not an HF checkpoint
    (config.json and safetensors weights). None for anything else (an HF folder, a folder with neither, a
    missing path), which the HF loader reports."""
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _head(path) == GGUF_MAGIC:
            return path
        raise CheckpointError(f"{str(path)!r} is a file, but not a GGUF file (no .gguf suffix, and it does not "
                              f"start with GGUF's magic bytes); pass a .gguf file or an HF model folder.")
    if path.suffix.lower() == ".gguf" and not path.exists():
        raise CheckpointError(f"no GGUF file at {str(path)!r}.")
    hf_weights = (path / loader.SINGLE_FILE).is_file() or (path / loader.SHARD_INDEX).is_file()
    if not path.is_dir() or ((path / "config.json").is_file() and hf_weights):
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
        raise CheckpointError(f"{str(path)!r} holds {len(found)} GGUF files ({names}); pass the one to load, "
                              f"such as Engine.from_pretrained({str(found[0])!r}).")
    return found[0] if found else None


def load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, Any]:
    """(model, tokenizer) from the GGUF file at `path`, its weights dequantized into `dtype` on `device`."""
    checkpoint = open_gguf(path)
    # Before the weights, as it can still fail; cached, so a second load takes a fraction of a second.
    tokenizer = gguf_tokenizer(checkpoint.path, checkpoint.metadata, checkpoint.num_tokens)
    return load_weights(checkpoint, device, dtype), tokenizer


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Read and check the file's metadata and tensor table; loads no weight."""
    head = _head(path)
    if head != GGUF_MAGIC:
        raise CheckpointError(f"{str(path)!r} is not a GGUF file: it starts with {head!r}, not GGUF's magic "
                              f"bytes {GGUF_MAGIC!r}. It may be another format, or a failed download.")
    try:
        reader = _Reader(path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as error:
        raise CheckpointError(f"{str(path)!r} is not a readable GGUF file; it may be truncated or corrupt "
                              f"({path.stat().st_size:,} bytes; reading it failed with {type(error).__name__}: "
                              f"{error}). Download or convert it again.") from None
    if reader.byte_order != "I":  # the dequantizers read little-endian blocks
        raise UnsupportedModel(f"{str(path)!r} is a big-endian GGUF; dendrite-nb reads little-endian ones (the "
                               f"usual kind): convert the model again without --bigendian.")
    size = path.stat().st_size
    short = next((t for t in reader.tensors if t.data_offset + t.n_bytes > size), None)
    if short is not None:
        raise CheckpointError(f"{str(path)!r} is truncated: tensor {short.name} ends at byte "
                              f"{short.data_offset + short.n_bytes:,}, the file has {size:,}. Download it again.")
    arch = text(reader, Keys.General.ARCHITECTURE, path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"{str(path)!r} is a GGUF of architecture {arch!r}, which dendrite-nb does not run; "
                               f"it runs GGUF architectures {', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, "
                               f"Mistral, SmolLM2, Qwen2/2.5, Qwen3, Phi-3).")
    _check_types(reader, path)
    parts = field(reader, Keys.Split.LLM_KV_SPLIT_COUNT, path, None)
    if parts is not None and parts > 1:
        raise UnsupportedModel(f"{str(path)!r} is one part of a GGUF split into {parts} files; merge them into one "
                               f"(llama-gguf-split --merge FIRST_PART OUT.gguf) and load that.")
    names = {t.name: t for t in reader.tensors}
    config = gguf_config(reader, path, arch, names)
    plan = _plan(config, arch, names, path)
    tokens = reader.fields.get(Keys.Tokenizer.LIST)
    if tokens is None:
        raise CheckpointError(f"{str(path)!r} has no tokenizer ({Keys.Tokenizer.LIST} is missing); dendrite-nb "
                              f"reads the tokenizer from the file's metadata.")
    if len(tokens.data) > config.vocab_size:
        raise CheckpointError(f"{str(path)!r} lists {len(tokens.data):,} tokens, its token_embd.weight has "
                              f"{config.vocab_size:,} rows.")
    first_info = reader.tensors[0].field.offset if reader.tensors else reader.data_offset
    return GGUFCheckpoint(path, reader, arch, config, plan, memoryview(reader.data[:first_info]), len(tokens.data))


def load_weights(checkpoint: GGUFCheckpoint, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Dequantize each tensor into its preallocated parameter(s), one tensor at a time."""
    model = loader.empty_model(checkpoint.config, device, dtype)
    params = dict(model.named_parameters())
    model.stored_above_4_bits = above_4_bits(checkpoint)
    with torch.no_grad():
        for name, piece in read_pieces(checkpoint, model):
            params[name].copy_(piece)
    return model


def above_4_bits(checkpoint: GGUFCheckpoint) -> set[str]:
    """The parameters the file stores quantized above 4 bits (what int4 weights keep in int8)."""
    return {name for tensor in checkpoint.reader.tensors if tensor.tensor_type in ABOVE_4_BITS
            for name in checkpoint.plan.get(tensor.name, ())}


def read_pieces(checkpoint: GGUFCheckpoint, model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, its whole value dequantized to float32 on the CPU) for each parameter of `model` (shapes
    only are read: a meta model will do), one file tensor at a time; as loader.read_pieces for safetensors."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config, plan = checkpoint.config, checkpoint.plan
    processor = TENSOR_PROCESSORS.get(checkpoint.arch, TensorProcessor)(
        config={"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads})
    params = dict(model.named_parameters())
    file_bytes = checkpoint.path.stat().st_size
    # `disable` is passed only to silence small loads, so that TQDM_DISABLE still governs the big ones.
    quiet = {"disable": True} if file_bytes < loader.PROGRESS_MIN_BYTES else {}
    with tqdm(total=len(plan), desc=f"loading {checkpoint.path.name}", unit=" tensors", leave=False,
              **quiet) as bar:
        for tensor in checkpoint.reader.tensors:
            targets = plan.get(tensor.name)
            if targets is None:  # read into the config (rope_freqs)
                continue
            values = dequantize(tensor.data, tensor.tensor_type)  # float32 [rows, cols], torch order
            values = processor.process(weights=values, name=tensor.name).weights
            # A plain F32 tensor comes back as a read-only view of the memory map; torch wants to own it.
            full = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
            parts = [params[name] for name in targets]
            yield from zip(targets, full.split([p.shape[0] for p in parts]))
            bar.update()


def _head(path: Path) -> bytes:
    with open(path, "rb") as file:
        return file.read(len(GGUF_MAGIC))


def _check_types(reader: GGUFReader, path: Path) -> None:
    unsupported = [t for t in reader.tensors if t.tensor_type not in SUPPORTED_TYPES]
    if unsupported:
        kinds = sorted({t.tensor_type.name for t in unsupported})
        raise UnsupportedModel(
            f"{str(path)!r} holds {len(unsupported)} tensor(s) of type {', '.join(kinds)} (such as "
            f"{unsupported[0].name}); dendrite-nb reads GGUF tensors of type "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)}. Use a file quantized to one of those "
            f"(Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, F16, ...).")


def _plan(config: ModelConfig, arch: str, names: dict[str, Any], path: Path) -> dict[str, tuple[str, ...]]:
    """GGUF tensor -> model parameters, checked both ways against the file and by shape."""
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}
    name_map = get_tensor_name_map(_ARCH_ENUM[arch], config.num_layers)
    gguf_name = lambda hf_name: name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))  # noqa: E731
    plan: dict[str, tuple[str, ...]] = {}
    for param in shapes:
        prefix, fused = _fused_on_disk(param)
        # Phi-3 files fuse q/k/v (llama.cpp accepts them apart too) and always gate/up; elsewhere ffn_up is up.
        if arch == "phi3" and fused is not None and gguf_name(prefix + fused) in names:
            plan[gguf_name(prefix + fused)] = tuple(prefix + part for part in loader.FUSED_ON_DISK[fused])
        else:
            plan[gguf_name(param) or param] = (param,)
    expected = set(plan) | ({ROPE_FREQS} if config.rope_factors is not None else set())
    missing, unexpected = sorted(set(plan) - names.keys()), sorted(names.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"tensors in {str(path)!r} do not match its metadata ({config.describe()}): "
                              f"{loader.describe_mismatch(missing, unexpected)}.")
    for name, targets in plan.items():
        implied = (sum(shapes[t][0] for t in targets), *shapes[targets[0]][1:])
        if torch_shape(names[name]) != implied:
            raise CheckpointError(f"tensor {name} in {str(path)!r} has shape {torch_shape(names[name])}, its "
                                  f"metadata ({config.describe()}) implies {implied}.")
    return plan


def _fused_on_disk(param: str) -> tuple[str, str | None]:
    """(layer prefix, name of the fused tensor that holds `param` in Phi-3 checkpoints), or (param, None)."""
    for fused, parts in loader.FUSED_ON_DISK.items():
        for part in parts:
            if param.endswith(part):
                return param[: -len(part)], fused
    return param, None
