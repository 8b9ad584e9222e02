"""What a caller of the llama.cpp peer names without loading llama.cpp itself: its error and its settings. A process
that runs the engine on a GPU imports these, and leaves llama.cpp's libraries to a worker process of its own
(llama_worker.py): two CUDA users in one process are one more thing that can break."""
from __future__ import annotations

from dataclasses import dataclass

KV_TYPE_NAMES = ("f32", "f16", "q8_0")  # llama_cpp_peer.KV_TYPES maps each to its ggml type
# How llama.cpp spreads a model over the GPUs it sees (llama_split_mode): "none" keeps it on one GPU, "layer" gives
# each GPU a run of whole layers (one GPU works at a time), "row" splits each weight matrix's rows over them (every
# GPU works on every layer), "tensor" splits the weights and the KV as tensor parallelism does (experimental in
# llama.cpp; it needs flash attention).
SPLIT_MODES = ("none", "layer", "row", "tensor")


class LlamaCppError(RuntimeError):
    """llama.cpp refused a load, a context or a decode; the message says which and what to change."""


@dataclass(frozen=True)
class LlamaSetting:
    """A context's knobs that change its speed (not its results, up to rounding)."""

    threads: int
    flash_attn: bool
    kv_type: str  # one of KV_TYPE_NAMES
    backend_sampling: bool = False  # greedy in llama.cpp's graph (llama_sampler_seq_config), not on the host

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPE_NAMES:
            raise ValueError(f"kv_type {self.kv_type!r} is not one of {sorted(KV_TYPE_NAMES)}.")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}.")

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}, FA {'on' if self.flash_attn else 'off'}, " \
               f"KV {self.kv_type}" + (", greedy in the graph" if self.backend_sampling else "")
