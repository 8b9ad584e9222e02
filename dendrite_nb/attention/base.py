"""The attention interface: plan once per forward (host-side metadata), run once per layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """One forward's sequences, host-side. Sequence i contributes q_lens[i] new tokens, laid out in order."""

    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # context per sequence after the new tokens are written
    block_tables: list[list[int]]  # physical block per logical block index, per sequence

    @property
    def positions(self) -> list[int]:
        return [p for q, kv in zip(self.q_lens, self.kv_lens) for p in range(kv - q, kv)]


class AttentionBackend(Protocol):
    name: str

    def plan(self, layout: BatchLayout, block_size: int, device: torch.device) -> Any:
        """Build the per-forward metadata (device tensors) shared by every layer. Mutates nothing."""

    def append_kv(self, plan: Any, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' k, v [T, kv_heads, head_dim] into the caches [blocks, block, kv_heads, head_dim]."""

    def attend(self, plan: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [T, heads, head_dim] over each sequence's cached context -> [T, heads, head_dim]."""
