"""What every rank of a tensor-parallel engine builds its shard from: a checkpoint path or a random-weight config,
and the dtype. It crosses to the workers pickled (plain data); each rank builds its own shard from it
(build_shard) and a checksum of the whole model, which rank 0 compares."""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..model.config import ModelConfig
from ..model.transformer import CausalLM


class ModelSpec(NamedTuple):
    checkpoint: str | None  # an HF folder or a GGUF (Engine.from_pretrained), or None for random weights
    hf_config: dict[str, Any] | None  # the config of random weights (Engine.from_random)
    weight_seed: int  # of random weights
    dtype: torch.dtype
    weights: str | None = None  # a quantized format (model/quantized_linear.py), applied to each shard after it

    def config(self) -> ModelConfig:
        """The model's shape, read without loading a weight (what a bad tensor_parallel is checked against)."""
        if self.checkpoint is None:
            return ModelConfig.from_hf(self.hf_config)
        from ..model.gguf import find_gguf, open_gguf
        from ..model.loader import read_config

        gguf_file = find_gguf(Path(self.checkpoint))
        return open_gguf(gguf_file).config if gguf_file is not None else read_config(Path(self.checkpoint))[0]

    def build_shard(self, rank: int, world: int, device: torch.device,
                    tokenizer: bool = True) -> tuple[CausalLM, Any, Path | None, list[float], str]:
        """(rank's shard of the model on `device`, the tokenizer or None, where it came from, the whole model's
        checksum and fingerprint). Random weights are drawn, and a checkpoint's tensors read, a parameter at a
        time and cut at once (stream_shard.py), so no rank holds the whole model. Workers pass tokenizer=False:
        they never see text, and an HF tokenizer costs seconds of importing transformers."""
        from ..engine.build import hf_tokenizer
        from ..model import gguf, loader
        from .random_shard import random_shard
        from .stream_shard import meta_model, shard_from_stream

        if self.checkpoint is None:
            model, checksum, whole = random_shard(self.config(), device, self.dtype, self.weight_seed, rank, world)
            return model, None, None, checksum, whole
        path = Path(self.checkpoint)
        gguf_file = gguf.find_gguf(path)
        if gguf_file is not None:
            checkpoint = gguf.open_gguf(gguf_file)
            model = meta_model(checkpoint.config, self.dtype)
            pieces, origin = gguf.read_pieces(checkpoint, model), gguf_file
            tokens = (gguf.gguf_tokenizer(checkpoint.path, checkpoint.metadata, checkpoint.num_tokens)
                      if tokenizer else None)
        else:
            model = meta_model(loader.read_config(path)[0], self.dtype)
            pieces, origin = loader.read_pieces(path, model), path
            tokens = hf_tokenizer(path) if tokenizer else None
        model, checksum, whole = shard_from_stream(model, pieces, device, self.dtype, rank, world)
        if gguf_file is not None:
            model.stored_above_4_bits = gguf.above_4_bits(checkpoint)
        return model, tokens, origin, checksum, whole
