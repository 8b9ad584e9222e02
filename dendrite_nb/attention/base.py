"""The attention interface: plan once per forward (host-side metadata), run once per layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch


class KVSegment(NamedTuple):
    """A run of context positions [start, end) that several batch rows read at once (tree-aware decode).

    The rows' contexts are identical over [start, end), because the rows descend from one tree node;
    a kernel reads these positions once for all of them and merges the partial results by log-sum-exp.
    Immutable. A tuple, not a frozen dataclass: a decode step makes one per row (each row's growing private
    run), and a tuple is made 4x faster.
    """

    rows: tuple[int, ...]  # batch rows (indices into the layout's sequences) that attend to these positions
    start: int  # first context position
    end: int  # one past the last context position
    blocks: tuple[int, ...]  # physical block of each logical block start // block_size .. (end - 1) // block_size


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """One forward's sequences, host-side. Sequence i contributes q_lens[i] new tokens, laid out in order."""

    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # context per sequence after the new tokens are written
    block_tables: list[list[int]]  # physical block per logical block index, per sequence
    # Decode only (every q_len is 1): each row's context [0, kv_len) cut into segments, shared ones read
    # once for all their rows. None: every row reads its own block table (flat paged attention).
    segments: list[KVSegment] | None = None

    @property
    def positions(self) -> list[int]:
        if self.is_decode:  # each row's one new token sits at its last position: no per-token loop
            return [kv - 1 for kv in self.kv_lens]
        return [p for q, kv in zip(self.q_lens, self.kv_lens) for p in range(kv - q, kv)]

    @property
    def is_decode(self) -> bool:
        return self.q_lens.count(1) == len(self.q_lens)  # one C loop: a decode step of 1,000 rows asks twice


class LayerKV(NamedTuple):
    """One layer's slice of the KV pool. Caches are [num_blocks, block_size, kv_heads, head_dim] in the pool's
    kv dtype. With an fp8 pool each token's K and V head vectors carry their own dequantisation scale."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads] float32, fp8 pools only
    v_scale: torch.Tensor | None = None


class AttentionBackend(Protocol):
    """What the model calls. Optional: attend_with_rope(plan, kv, q, k, v, cos, sin, qk_norm_weights, eps) ->
    [T, heads, head_dim], RoPE on the raw q and k, append_kv and attend in fewer launches; the fused model uses
    it where a backend has it (triton) and otherwise runs kernels.rope_qk, append_kv, then attend."""

    name: str
    # Whether attend() reads BatchLayout.segments (the engine only builds them for backends that do).
    reads_segments: bool

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
