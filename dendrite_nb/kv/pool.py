"""Preallocated KV storage plus the allocator that hands out its blocks."""
from __future__ import annotations

import torch

from ..attention.base import LayerKV
from .allocator import BlockAllocator

# A finite poison: 0 * NaN would leak NaN through masked attention, a finite value only shows where read.
CANARY = -7777.0


class KVPool:
    """kv [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; blocks are shared by all layers."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, canaries: bool = False):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size, self.canaries = block_size, canaries
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.allocator = BlockAllocator(
            num_blocks,
            on_allocate=self._check_canaries if canaries else None,
            on_free=self._poison if canaries else None,
        )
        if canaries:
            self.kv.fill_(CANARY)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def layers(self) -> list[LayerKV]:
        """Per layer LayerKV(k, v), each cache [num_blocks, block_size, kv_heads, head_dim]."""
        return [LayerKV(layer[0], layer[1]) for layer in self.kv]

    def copy_block(self, src: int, dst: int) -> None:
        self.kv[:, :, dst] = self.kv[:, :, src]

    def _poison(self, block_ids: list[int]) -> None:
        self.kv[:, :, block_ids] = CANARY

    def _untouched(self, block_ids: list[int]) -> bool:
        return bool((self.kv[:, :, block_ids] == CANARY).all())

    def _check_canaries(self, block_ids: list[int]) -> None:
        if not self._untouched(block_ids):
            raise AssertionError(f"KV canary broken: a free block among {block_ids[:8]} was written after it was freed")

    def verify_free_blocks(self) -> None:
        """With canaries on: every free block still holds the poison (nothing wrote into freed memory)."""
        free = self.allocator.free_blocks()
        if self.canaries and free:
            self._check_canaries(free)
