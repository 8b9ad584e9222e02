"""Architecture shapes for locally built checkpoints.

The tiny shapes are deliberately varied rather than minimal. Between them they cover
GQA and MHA, tied and untied embeddings, llama3 rope scaling and plain rope, Qwen3's
head_dim * heads != hidden, Qwen2's q/k/v biases (and none on o), Llama's biases on all four, and Phi-3's fused
q/k/v and gate/up tensors on disk. An engine that hard-codes any one of those assumptions fails
at least one shape. The real shapes hold the published numbers, so benchmarks can build
random-weight models at true size without downloading anything. Their token ids match
the published config.json files.
"""

from dataclasses import dataclass, field
from typing import Any

from transformers import LlamaConfig, MistralConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen3Config

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "mistral": MistralConfig, "phi3": Phi3Config, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


@dataclass(frozen=True)
class CheckpointShape:
    """A model family plus the config kwargs for it.

    Tiny shapes leave out vocab_size and the special-token ids, which come from the
    tokenizer trained alongside them.
    """

    family: str
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in _CONFIG_CLASSES:
            raise ValueError(f"unknown family {self.family!r}; expected one of {sorted(_CONFIG_CLASSES)}")

    def hf_config(self, **overrides: Any) -> dict[str, Any]:
        """The config.json dict, e.g. for Engine.from_random(REAL_SHAPES["llama-3.1-8b"].hf_config(), "cuda")."""
        return {"model_type": self.family, **self.config, **overrides}


def _llama3_rope(theta: float, factor: float, original_max: int) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_max,
    }


def _default_rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


TINY_SHAPES: dict[str, CheckpointShape] = {
    # original_max_position_embeddings=64 is tiny so that short test prompts already
    # reach the part of the spectrum that llama3 scaling changes.
    "llama-gqa-untied": CheckpointShape("llama", {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rope_parameters": _llama3_rope(500000.0, 8.0, 64),
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
    }),
    "llama-mha-tied": CheckpointShape("llama", {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_parameters": _default_rope(10000.0),
        "max_position_embeddings": 2048,
    }),
    "qwen3-gqa-tied": CheckpointShape("qwen3", {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "rope_parameters": _default_rope(1000000.0),
        "max_position_embeddings": 2048,
    }),
    # Qwen2 / Qwen2.5: biases on q, k and v only.
    "qwen2-gqa-tied": CheckpointShape("qwen2", {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": _default_rope(1000000.0),
        "max_position_embeddings": 2048,
        "use_sliding_window": False,
        "sliding_window": 2048,  # as real Qwen2 configs carry one, unused without use_sliding_window
    }),
    # Mistral, and a Llama with attention_bias (all four attention products carry one); no tiny shape
    # has a window below its positions, which test_loader covers.
    "mistral-gqa-untied": CheckpointShape("mistral", {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rope_parameters": _default_rope(1000000.0),
        "max_position_embeddings": 2048,
        "sliding_window": None,
    }),
    # Phi-3 / Phi-4: q/k/v in one tensor and gate/up in another, on disk.
    "phi3-gqa-untied": CheckpointShape("phi3", {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rope_parameters": _default_rope(10000.0),
        "max_position_embeddings": 2048,
        "sliding_window": None,
    }),
    "llama-biased": CheckpointShape("llama", {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": _default_rope(10000.0),
        "max_position_embeddings": 2048,
    }),
    "qwen3-mha-untied": CheckpointShape("qwen3", {
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
    }),
}

REAL_SHAPES: dict[str, CheckpointShape] = {
    "qwen3-0.6b": CheckpointShape("qwen3", {
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rope_parameters": _default_rope(1000000.0),
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
    }),
    "llama-3.2-1b": CheckpointShape("llama", {
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_parameters": _llama3_rope(500000.0, 32.0, 8192),
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    }),
    "llama-3.1-8b": CheckpointShape("llama", {
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_parameters": _llama3_rope(500000.0, 8.0, 8192),
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    }),
    # One card cannot hold it in bf16 (141 GB): the tensor-parallel benchmark's (benchmarks/tensor_parallel.py).
    "llama-3.1-70b": CheckpointShape("llama", {
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_parameters": _llama3_rope(500000.0, 8.0, 8192),
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    }),
}


def make_config(shape: CheckpointShape, **overrides: Any) -> PretrainedConfig:
    """Build the transformers config for `shape`; `overrides` win over the shape's values."""
    return _CONFIG_CLASSES[shape.family](**{**shape.config, **overrides})
