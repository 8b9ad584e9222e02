"""What every rank of a tensor-parallel engine builds its whole model from: a checkpoint path or a random-weight
config, and the dtype. It crosses to the workers pickled (plain data), and each rank builds the same whole model
from it before keeping its shard (distributed/shard.py)."""
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

    def build(self, device: torch.device, tokenizer: bool = True) -> tuple[CausalLM, Any, Path | None]:
        """(the whole model, its tokenizer or None, the file or folder it came from or None). Random weights are
        drawn on `device` (the rank's own), as Engine.from_random draws them there at tensor_parallel=1: a
        generator's numbers depend on the kind of device it runs on, and a GPU draws an 8B model in a second where
        a CPU takes a minute. A checkpoint loads on the CPU. Workers pass tokenizer=False: they never see text,
        and an HF tokenizer costs seconds of importing transformers."""
        from ..engine import build
        from ..model.gguf import find_gguf, load_weights, open_gguf
        from ..model.loader import load_model, read_config

        cpu = torch.device("cpu")
        if self.checkpoint is None:
            return build.random_weights(self.hf_config, device, self.dtype, self.weight_seed), None, None
        if tokenizer:
            return build.load_checkpoint(self.checkpoint, cpu, self.dtype)
        path = Path(self.checkpoint)
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return load_weights(open_gguf(gguf_file), cpu, self.dtype), None, gguf_file
        return load_model(path, read_config(path)[0], cpu, self.dtype), None, path
