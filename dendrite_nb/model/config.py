"""The model shape, read from an HF `config.json` (transformers 4.x and 5.x spellings both)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import CheckpointError, UnsupportedModel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3")
# Checkpoint families by model_type, for messages.
_FAMILY_NAMES = "Llama 3, Mistral, Phi-3 / Phi-4, Qwen2 / Qwen2.5 and Qwen3"
# Families whose `sliding_window` applies to every layer (Qwen2 carries one that is off by default).
_WINDOWED_EVERYWHERE = ("mistral", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# The sizes a config must give, and those it may (each a positive int where given).
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 scaling parameters, or None for plain RoPE
    max_position_embeddings: int  # the longest context this engine runs: a sliding window caps it (below)
    tie_word_embeddings: bool
    qkv_bias: bool  # Llama's attention_bias, and always in Qwen2
    o_bias: bool  # Llama's attention_bias; never in Qwen2
    mlp_bias: bool
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mistral's or Phi-3's sliding window, when it is shorter than the model's positions. Inside it, attention
    # over the whole context is exactly the model's, so max_position_embeddings stops there.
    sliding_window: int | None = None
    # A GGUF's Llama 3 scaling: llama.cpp stores no parameters, only each frequency's divisor (its rope_freqs
    # tensor, [head_dim // 2]); rope_scaling is then None.
    rope_factors: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """The shape of an HF config (config.json's contents). A field missing or of the wrong kind is a
        CheckpointError naming it; a model this engine does not run, UnsupportedModel."""
        raw = config_dict(raw)
        _check_sizes(raw)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported; dendrite-nb runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                f"({_FAMILY_NAMES} checkpoints)."
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not supported; only silu (SwiGLU) is.")
        if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
            raise UnsupportedModel("sliding-window attention in some layers (use_sliding_window=true) is not "
                                   "supported; every layer must attend to the whole context.")
        # transformers 5 writes `rope_parameters`; 4.x checkpoints carry `rope_theta` + `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(f"rope type {rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}.")
        rotary_fraction = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
        if rotary_fraction != 1.0:  # Phi-4-mini rotates 3/4 of each head
            raise UnsupportedModel(f"partial_rotary_factor {rotary_fraction} is not supported; RoPE must rotate "
                                   f"whole heads (1.0).")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        max_positions = raw.get("max_position_embeddings", 2048)
        window = raw.get("sliding_window") if model_type in _WINDOWED_EVERYWHERE else None
        window = window if window is not None and window < max_positions else None
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=window or max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at one byte per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def describe(self) -> str:
        return (f"{self.model_type} {self.num_layers}L h{self.hidden_size} "
                f"{self.num_heads}q/{self.num_kv_heads}kv heads x{self.head_dim}")


def config_dict(raw: Any) -> dict[str, Any]:
    """A copy of an HF config given as a mapping; CheckpointError for anything else (a model's name, say)."""
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"a model config is a dict (the contents of an HF config.json), got "
                              f"{type(raw).__name__} {raw!r:.80}.")
    return dict(raw)


def _check_sizes(raw: dict[str, Any]) -> None:
    """CheckpointError for a size the config lacks or gives as something other than a positive int, or attention
    heads that do not split the hidden size (when no head_dim says how wide a head is)."""
    missing = [key for key in _REQUIRED_SIZES if key not in raw]
    if missing:
        raise CheckpointError(f"the model config has no {', '.join(missing)}; an HF config.json gives "
                              f"{', '.join(_REQUIRED_SIZES)}.")
    for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        value = raw.get(key)
        if key in _OPTIONAL_SIZES and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"the model config's {key} must be a positive integer, got {value!r}.")
    if not raw.get("head_dim") and raw["hidden_size"] % raw["num_attention_heads"]:
        raise CheckpointError(f"the model config's num_attention_heads ({raw['num_attention_heads']}) does not divide "
                              f"its hidden_size ({raw['hidden_size']}), and it gives no head_dim.")
