"""One rank's shard of a random-weight model, drawn without ever holding the whole model: what lets a model that no
single GPU can hold (a 70B shape at tensor_parallel=2) be built from Engine.from_random.

The parameters are drawn one at a time, in the order and from the generator that loader.random_model draws them
(the same numbers as Engine.from_random's model at tensor_parallel=1 on the same kind of device), and each is cut to
the rank's part at once (stream_shard.py).
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..model.config import ModelConfig
from ..model.transformer import CausalLM
from .stream_shard import meta_model, shard_from_stream


def random_shard(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int, rank: int,
                 world: int) -> tuple[CausalLM, list[float], str]:
    """(rank's shard of the random model, the whole model's checksum, the whole model's fingerprint)."""
    model = meta_model(config, dtype)
    return shard_from_stream(model, _draws(model, device, dtype, seed), device, dtype, rank, world)


def _draws(model: CausalLM, device: torch.device, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter drawn whole, in random_model's order: the generator's stream."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        whole = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            whole.fill_(1.0)
        else:
            whole.normal_(0.0, 0.02, generator=generator)
        yield name, whole
