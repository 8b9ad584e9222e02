"""Building a tensor-parallel engine (Engine.from_pretrained / from_random with tensor_parallel > 1): check the
request before anything starts, start the workers, build and check rank 0's shard, and hand both to the engine.

Every rank builds its shard from the same ModelSpec (the same file's tensors read, or the same config and seed's
parameters drawn, one at a time on the rank's device, each cut at once: stream_shard.py) and checks that its
checksum of the whole model equals rank 0's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig
from ..engine.build import check_backend_request
from ..errors import TensorParallelError
from ..model.transformer import CausalLM
from .group import TensorGroup
from .shard import check_degree, check_int4_split, connect, quantize_shard
from .spec import ModelSpec


def check_request(spec: ModelSpec, world: int, settings: EngineConfig) -> None:
    """TensorParallelError (or the checkpoint's or the backend's own error) for a request that cannot run; starts
    nothing. spec.weights must have passed quantized_linear.check_weights for the device."""
    device = settings.device
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        raise TensorParallelError(f"tensor_parallel={world} from {device} needs GPUs cuda:{device.index or 0} to "
                                  f"cuda:{(device.index or 0) + world - 1}; this machine has "
                                  f"{torch.cuda.device_count()}.")
    config = spec.config()
    check_degree(world, config)
    if spec.weights == "int4":
        check_int4_split(config, world)
    check_backend_request(config, spec.dtype, settings)   # what the engine would raise once the workers had started


def start(spec: ModelSpec, world: int, device: torch.device) -> tuple[CausalLM, Any, Path | None, TensorGroup]:
    """(rank 0's shard on its device, the tokenizer, where the weights came from, the running workers)."""
    group = TensorGroup(world, device, spec)
    try:
        # In lockstep: a failure here (Ctrl-C included) can leave the workers inside a collective of the load, where
        # no close command reaches them, so they are ended at once, not asked to close.
        with group.lockstep("loading the model"):
            model, tokenizer, origin, checksum, model.whole_fingerprint = spec.build_shard(0, world,
                                                                                           group.rank_device(0))
            group.check_weights(checksum)
            if spec.weights is not None:   # with the workers, product by product (their scales agree)
                quantize_shard(model, spec.weights, group.max_over_ranks)
            connect(model, 0, world, group.all_reduce)
    except BaseException:
        group.close()
        raise
    return model, tokenizer, origin, group
