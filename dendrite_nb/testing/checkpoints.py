"""Write random-weight HF-format checkpoints (tokenizer + config + safetensors) to disk."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoTokenizer, LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, PreTrainedModel,
                          Qwen2ForCausalLM, Qwen3ForCausalLM)

from dendrite_nb.paths import default_cache_dir, unwritable_cache, user_path
from dendrite_nb.testing.shapes import TINY_SHAPES, make_config
from dendrite_nb.testing.tokenizer import write_bpe_tokenizer

_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

# The stock 0.02 init gives near-uniform logits, so greedy decoding from a tiny model
# is decided by rounding noise, or it repeats one token forever. At 0.4 the logits have
# a std of about 3. Over 8 seeds x 5 prompts, 30 greedy steps gave at least 8 distinct
# tokens on every tiny shape. Smaller ranges (and larger tied embeddings) fell into loops.
_INITIALIZER_RANGE = 0.4
# Norm weights start at exactly 1.0, so a kernel that skipped them would still give
# the right answer. Jittering them makes that kind of bug show up in tests.
_NORM_JITTER = 0.1
# Biases start at exactly 0 for the same reason; these shift every product that has one.
_BIAS_STD = 0.2

_EOS_TOKEN = {"llama": "<|end_of_text|>", "mistral": "</s>", "phi3": "<|endoftext|>", "qwen2": "<|endoftext|>", "qwen3": "<|endoftext|>"}

# Bump the version whenever the demo model's contents change, so stale caches are ignored.
_DEMO_NAME = "demo-llama-v1"
_DEMO_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
}
_DEMO_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def write_tiny_checkpoint(
    folder: str | Path,
    shape: str = "llama-gqa-untied",
    *,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a float32 random-weight checkpoint of TINY_SHAPES[shape] into `folder`.

    vocab_size and the special-token ids come from the tokenizer written alongside.
    `config_overrides` win over both the shape and those values. For example, a
    vocab_size larger than the tokenizer's imitates Qwen's padded embedding matrix.
    With `max_shard_bytes` the weights are split into shards with an index file, as in
    large published checkpoints. Otherwise they go into a single model.safetensors.
    """
    folder = Path(folder)
    spec = TINY_SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    write_bpe_tokenizer(folder, family=spec.family)
    tok = AutoTokenizer.from_pretrained(folder)

    settings: dict[str, Any] = {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.convert_tokens_to_ids(_EOS_TOKEN[spec.family]),
        "pad_token_id": tok.pad_token_id,
        "initializer_range": _INITIALIZER_RANGE,
        "dtype": "float32",
        **config_overrides,
    }
    if settings["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {settings['vocab_size']} < tokenizer size {len(tok)}")
    config = make_config(spec, **settings)

    torch.manual_seed(seed)
    model = _MODEL_CLASSES[spec.family](config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(_NORM_JITTER * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, _BIAS_STD)

    # transformers 5 always writes safetensors (safe_serialization is gone). An int
    # max_shard_size is in bytes, and tied lm_head weights are left out as upstream does.
    # transformers >= 5.2x draws a "Writing model shards" bar; it would land in notebook outputs.
    with _no_progress_bars():
        if max_shard_bytes is None:
            model.save_pretrained(folder)
        else:
            model.save_pretrained(folder, max_shard_size=max_shard_bytes)
    return folder


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _DEMO_FILES)


def demo_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Return the demo's tiny Llama checkpoint, building it in the cache on first use.

    The model is written into a temporary sibling folder and renamed into place. A
    crashed or concurrent writer therefore never leaves a half-written folder that a
    later call would trust.
    """
    cache = user_path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / _DEMO_NAME
    if _is_complete(target):
        return target

    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{_DEMO_NAME}-", dir=cache))
    except OSError as error:   # the cache (or a parent) is a file, or a folder we may not write
        given_as = "cache_dir" if cache_dir is not None else None
        raise unwritable_cache(cache, error, "build the demo model", given_as) from None
    try:
        write_tiny_checkpoint(staging, "llama-gqa-untied", **_DEMO_OVERRIDES)
        if target.exists() and not _is_complete(target):
            # Left over from older code or edited by hand; its contents can't be trusted.
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process won the race; its copy is identical to ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
