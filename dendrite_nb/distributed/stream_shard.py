"""One rank's shard of a model built from a stream of whole parameters, one at a time, so that no rank ever holds
the whole model: what lets a model that no single GPU (or host's memory, once per rank) can hold be split.

The stream is random draws (random_shard.py) or a checkpoint's tensors read one at a time (loader.read_pieces for
safetensors, gguf.read_pieces for GGUF). Each whole parameter goes to the rank's device, its sum and sample are kept
(the whole model's checksum, which every rank compares with rank 0's, and its fingerprint, persist.model_fingerprint,
what a save records), and it is cut to the rank's part at once: the most memory held beyond the shard is one whole
parameter.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..model.config import ModelConfig
from ..model.transformer import CausalLM
from ..persist import fingerprint, parameter_sample
from .shard import parameter_part, place


def meta_model(config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """The model's parameters on the meta device: their names and shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(config).to(dtype)


def shard_from_stream(model: CausalLM, pieces: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                      dtype: torch.dtype, rank: int, world: int) -> tuple[CausalLM, list[float], str]:
    """(rank's shard of `model`, a meta_model, with every parameter `pieces` brings, the whole model's checksum and
    fingerprint). pieces: (parameter name, its whole value in any float dtype, on any device)."""
    config = model.config
    sums: dict[str, float] = {}
    samples = {}
    with torch.no_grad():
        for name, value in pieces:
            whole = value.to(device=device, dtype=dtype)
            sums[name] = _sum(whole)
            samples[name] = parameter_sample(whole)
            place(model, name, whole, parameter_part(name, config, rank, world))
            del whole, value
    if config.tie_word_embeddings:
        model.tie_weights()   # the head still points at the embedding's meta parameter
        samples["lm_head.weight"] = samples["model.embed_tokens.weight"]   # state_dict lists a tied head twice
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"the stream left {left} unbuilt: CausalLM has parts this builder was not given")
    model.materialize(device)
    return model.eval(), [sums[name] for name in sorted(sums)], fingerprint(samples)


def _sum(tensor: torch.Tensor, chunk: int = 1 << 26) -> float:
    """The float64 sum of `tensor`, a chunk at a time: a 70B model's LM head in float64 at once would take 8 GB of
    a GPU already nearly full. One chunk (every tiny model's parameter) sums as weights_checksum does."""
    flat = tensor.reshape(-1)
    return sum(float(part.double().sum()) for part in flat.split(chunk))
