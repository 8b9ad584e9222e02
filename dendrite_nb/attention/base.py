"""The attention interface: plan once per forward (host-side metadata), run once per layer.

A backend's optional abilities are declared, not probed: each backend class sets `capabilities`, and callers
(the runner, the model, CUDA graphs, the engine) read those flags instead of asking whether a method exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

# What the cache hands to attention lives with the cache, so that kv never imports attention.
from ..kv.layout import BatchLayout, KVSegment, LayerKV


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend does beyond plan / append_kv / attend, declared by its class. A True flag promises the calls
    it names. The runner builds BatchLayout.segments only for tree_segments backends, and for a prefill of several
    sequences only where tree_prefill; the engine calls configure()
    only where needs_head_layout, captures CUDA graphs only where capturable_plans, and prefills in chunks of
    prefill_chunk_tokens unless told otherwise; the fused model calls attend_with_rope where fused_rope_attend.
    The figures behind the default chunk: benchmarks/REPORT.md, "Prefill by chunk size"."""

    tree_segments: bool = False      # attend() reads BatchLayout.segments: a shared tree node once for all its rows
    tree_prefill: bool = False       # and in a prefill too, where a row is several new tokens (causal within it)
    needs_head_layout: bool = False  # configure(num_heads, num_kv_heads, kv_dtype) runs before plan()
    capturable_plans: bool = False   # host_plan(), bind(), plan(shape=...): padded plans that CUDA graphs replay
    fused_rope_attend: bool = False  # attend_with_rope(): RoPE, KV append and attention in fewer launches a layer
    tma_loads: bool = False          # may load KV tiles of consecutive blocks through TMA; its `tma` setting says when
    prefill_chunk_tokens: int = 4096  # default tokens a prefill forward: long, as each costs the host alike


class AttentionBackend(Protocol):
    """What the model calls: plan() once per forward, append_kv() and attend() once per layer. The optional calls
    are promised by `capabilities` (see Capabilities); the fused model calls attend_with_rope where a backend
    declares it (triton) and otherwise runs kernels.rope_qk, append_kv, then attend."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int,
                           kv_dtype: torch.dtype) -> str | None:
        """Why this backend cannot run a model of this dtype / head_dim / KV dtype on `device`, or None."""

    def plan(self, layout: BatchLayout, block_size: int, device: torch.device) -> Any:
        """Build the per-forward metadata (device tensors) shared by every layer. Mutates nothing."""

    def append_kv(self, plan: Any, kv: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' k, v [T, kv_heads, head_dim] into the layer's caches (quantising for fp8)."""

    def attend(self, plan: Any, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """Causal attention of q [T, heads, head_dim] over each sequence's cached context -> [T, heads, head_dim]."""


class CapturableBackend(AttentionBackend, Protocol):
    """A backend with capabilities.capturable_plans: what CUDA graphs (cuda_graphs.py) and the runner call on it.
    A host plan has shape() -> a plan shape with fits(), padded() and numel, and pack(shape, trash_slot)."""

    def host_plan(self, layout: BatchLayout, block_size: int, device: torch.device) -> Any:
        """The plan's work items and index arrays on the host (no device work). Mutates nothing."""

    def bind(self, buffer: torch.Tensor, shape: Any) -> Any:
        """A plan whose tensors are views of `buffer` (int32, a packed host plan padded to `shape`)."""

    def plan(self, layout: BatchLayout, block_size: int, device: torch.device, shape: Any = None,
             trash_slot: int = 0, host: Any = None) -> Any:
        """plan(), padded to `shape` where given (padding tokens write to `trash_slot`), from `host` if made."""


__all__ = ["AttentionBackend", "BatchLayout", "Capabilities", "CapturableBackend", "KVSegment", "LayerKV"]
