"""Build a CausalLM from an HF folder (config.json + safetensors, single file or sharded), or with random weights.

GGUF files are read by gguf.py, which shares this module's empty model, fused-tensor names and progress bar."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from tqdm.std import tqdm  # the text bar: dendrite_nb imports no notebook code

from ..errors import CheckpointError
from .config import ModelConfig
from .transformer import CausalLM

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
# Older exports save the RoPE table; it is derived state, never a weight.
_DERIVED = ".rotary_emb.inv_freq"
# Checkpoints at least this big show a progress bar while they load (an 8B model takes tens of seconds
# from a cold disk); the tiny test and demo models load silently. TQDM_DISABLE=1 turns the bar off.
PROGRESS_MIN_BYTES = 256 * 2**20
# Phi-3 stores q/k/v and gate/up as one tensor each; the model keeps HF's separate names (and fuses them itself).
FUSED_ON_DISK = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                "self_attn.v_proj.weight"),
                  "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def describe_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """'missing tensor(s) a, b; unexpected tensor(s) c', naming five of each at most."""
    parts = [f"{what} tensor(s) {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
             for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
    return "; ".join(parts)


def _model_names(name: str) -> tuple[str, ...]:
    """The model's parameter names that a checkpoint tensor holds: itself, or the parts of a fused one."""
    for fused, parts in FUSED_ON_DISK.items():
        if name.endswith(fused):
            prefix = name[: -len(fused)]
            return tuple(prefix + part for part in parts)
    return (name,)


def read_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist.")
    if not path.is_file():
        raise CheckpointError(f"{str(folder)!r} has no config.json; expected an HF model folder "
                              f"(config.json, {SINGLE_FILE} or {SHARD_INDEX}, tokenizer files) or a GGUF "
                              f"(a .gguf file, or a folder holding one).")
    raw = _read_json(path)
    generation = folder / "generation_config.json"
    if generation.is_file():  # instruct checkpoints list their extra end tokens here
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            base = raw.get("eos_token_id")
            base = base if isinstance(base, list) else ([] if base is None else [base])
            raw = {**raw, "eos_token_id": list(dict.fromkeys(base + extra))}
    try:
        return ModelConfig.from_hf(raw), raw
    except CheckpointError as error:   # the file it came from, for the user to open
        raise type(error)(f"{path}: {error}") from None


def _read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; CheckpointError naming the file if it is not one."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); fix or replace the file.") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object of settings.")
    return value


def weight_files(folder: Path) -> dict[str, list[str]]:
    """safetensors file -> tensor names it should hold."""
    if (folder / SHARD_INDEX).is_file():
        weight_map: dict[str, str] = json.loads((folder / SHARD_INDEX).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{SHARD_INDEX} in {str(folder)!r} lists shard {missing[0]!r}, which is missing.")
        return files
    if (folder / SINGLE_FILE).is_file():
        with safe_open(folder / SINGLE_FILE, framework="pt") as f:
            return {SINGLE_FILE: list(f.keys())}
    raise CheckpointError(f"{str(folder)!r} has no {SINGLE_FILE} nor {SHARD_INDEX}; "
                          f"dendrite-nb reads safetensors weights only.")


def empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)  # cast while on meta: no memory is touched yet
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces meta parameters one by one, which unties them
    model.materialize(device)
    return model.eval()


def load_model(folder: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    model = empty_model(config, device, dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, piece in read_pieces(folder, model):
            params[name].copy_(piece)
    return model


def read_pieces(folder: Path, model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, its whole value as the file stores it, on the CPU) for each parameter of `model`, read one
    checkpoint tensor at a time and checked against the model's shapes (only shapes are read: a model on the meta
    device will do). Tied weights come once, under model.embed_tokens; a fused tensor on disk comes as its parts.
    What a tensor-parallel rank cuts its shard from, a parameter at a time (distributed/stream_shard.py)."""
    config = model.config
    params = dict(model.named_parameters())  # tied weights appear once, under model.embed_tokens
    files = weight_files(folder)
    on_disk = {part for names in files.values() for name in names if not name.endswith(_DERIVED)
               for part in _model_names(name)}
    tied_head = config.tie_word_embeddings and "lm_head.weight" in on_disk
    unexpected = sorted(on_disk - params.keys() - ({"lm_head.weight"} if tied_head else set()))
    missing = sorted(params.keys() - on_disk)
    if unexpected or missing:
        raise CheckpointError(f"weights in {str(folder)!r} do not match config.json ({config.describe()}): "
                              f"{describe_mismatch(missing, unexpected)}.")
    file_bytes = sum((folder / file).stat().st_size for file in files)
    # `disable` is passed only to silence small loads, so that TQDM_DISABLE still governs the big ones.
    quiet = {"disable": True} if file_bytes < PROGRESS_MIN_BYTES else {}
    with tqdm(total=len(params), desc=f"loading {folder.name}", unit=" tensors", leave=False, **quiet) as bar:
        for file, names in files.items():
            with safe_open(folder / file, framework="pt") as f:
                for name in names:
                    if name.endswith(_DERIVED) or (tied_head and name == "lm_head.weight"):
                        continue
                    tensor, parts = f.get_tensor(name), [params[part] for part in _model_names(name)]
                    implied = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
                    if tuple(tensor.shape) != implied:
                        raise CheckpointError(f"tensor {name} in {file} has shape {tuple(tensor.shape)}, "
                                              f"config.json implies {implied}.")
                    for named_piece in zip(_model_names(name), tensor.split([p.shape[0] for p in parts])):
                        yield named_piece
                        bar.update()


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """Random weights in memory, for speed work on real shapes (speed depends on shapes, not values)."""
    model = empty_model(config, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model
