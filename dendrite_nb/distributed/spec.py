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

    def config(self) -> ModelConfig:
        """The model's shape, read without loading a weight (what a bad tensor_parallel is checked against)."""
        if self.checkpoint is None:
            return ModelConfig.from_hf(self.hf_config)
        from ..model.gguf import find_gguf, open_gguf
        from ..model.loader import read_config

        gguf_file = find_gguf(Path(self.checkpoint))
        return open_gguf(gguf_file).config if gguf_file is not None else read_config(Path(self.checkpoint))[0]

    def _load_whole(self, tokenizer: bool) -> tuple[CausalLM, Any, Path]:
        """(the whole checkpoint's model on the CPU, its tokenizer or None, the file or folder it came from).
        Workers pass tokenizer=False: they never see text, and an HF tokenizer costs seconds of importing
        transformers."""
        from ..engine import build
        from ..model.gguf import find_gguf, load_weights, open_gguf
        from ..model.loader import load_model, read_config

        cpu = torch.device("cpu")
        if tokenizer:
            return build.load_checkpoint(self.checkpoint, cpu, self.dtype)
        path = Path(self.checkpoint)
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return load_weights(open_gguf(gguf_file), cpu, self.dtype), None, gguf_file
        return load_model(path, read_config(path)[0], cpu, self.dtype), None, path

    def build_shard(self, rank: int, world: int, device: torch.device,
                    tokenizer: bool = True) -> tuple[CausalLM, Any, Path | None, list[float], str]:
        """(rank's shard of the model on `device`, the tokenizer or None, where it came from, the whole model's
        checksum and fingerprint). Random weights are drawn a parameter at a time and cut at once
        (random_shard.py), so no rank holds the whole model; a checkpoint is still loaded whole on the CPU first,
        then cut."""
        from ..persist import model_fingerprint
        from .random_shard import random_shard
        from .shard import shard_weights, weights_checksum

        if self.checkpoint is None:
            model, checksum, whole = random_shard(self.config(), device, self.dtype, self.weight_seed, rank, world)
            return model, None, None, checksum, whole
        model, tokens, origin = self._load_whole(tokenizer)
        checksum, whole = weights_checksum(model), model_fingerprint(model)
        shard_weights(model, rank, world)
        model = model.to(device)
        model.materialize(device)
        return model, tokens, origin, checksum, whole
