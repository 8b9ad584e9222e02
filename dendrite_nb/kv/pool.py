"""Preallocated KV storage plus the allocator that hands out its blocks."""
from __future__ import annotations

import torch

from .allocator import BlockAllocator
from .fp8 import FP8_DTYPE
from .layout import LayerKV

# A finite poison: 0 * NaN would leak NaN through masked attention, a finite value only shows where read.
# Exact in float32, bf16, fp16 and e4m3 (whose largest value is 448). A written fp8 vector is never all
# -416: its largest element always quantises to +-448.
CANARY = -416.0
SCALE_BYTES = 4  # one float32 per token, KV head and K/V, fp8 pools only


class KVPool:
    """kv [num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]; blocks are shared by all layers.
    The last block is never allocated: it is the sink for writes that must land somewhere harmless.

    An fp8 (float8_e4m3fn) pool also holds scales [num_layers, 2, num_blocks + 1, block_size, kv_heads] float32,
    the dequantisation scale of each stored K and V head vector (see kv/fp8.py); other pools have scales None.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, canaries: bool = False):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size, self.canaries = block_size, canaries
        # One block past the allocator's: a sink where padding rows of a captured CUDA graph write their KV.
        storage = num_blocks + 1
        self.sink_slot = num_blocks * block_size
        self.bytes_per_block = self.block_bytes(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                block_size=block_size, dtype=dtype)
        try:
            self.kv = torch.zeros(num_layers, 2, storage, block_size, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)
            self.scales = None
            if dtype == FP8_DTYPE:
                self.scales = torch.zeros(num_layers, 2, storage, block_size, num_kv_heads, device=device)
        except (torch.OutOfMemoryError, RuntimeError) as error:   # CPU allocators raise RuntimeError
            raise ValueError(f"num_blocks={num_blocks:,} needs {num_blocks * self.bytes_per_block / 2**30:,.1f} GiB "
                             f"of {device} memory for the KV pool, which cannot be allocated "
                             f"({str(error).splitlines()[0][:120]}); ask for fewer blocks.") from None
        self.allocator = BlockAllocator(
            num_blocks,
            on_allocate=self._check_canaries if canaries else None,
            on_free=self._poison_freed if canaries else None,
            on_give_back=self._poison if canaries else None,
        )
        if canaries:
            self._poison(slice(None))

    @staticmethod
    def block_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers: K and V, plus their scales in an fp8 pool."""
        vectors = num_layers * 2 * block_size * num_kv_heads
        return vectors * (head_dim * dtype.itemsize + (SCALE_BYTES if dtype == FP8_DTYPE else 0))

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def layers(self) -> list[LayerKV]:
        """Per layer LayerKV(k, v, k_scale, v_scale): caches [num_blocks + 1, block_size, kv_heads, head_dim],
        scales [num_blocks + 1, block_size, kv_heads] (None unless fp8). Views: writes land in the pool."""
        if self.scales is None:
            return [LayerKV(layer[0], layer[1]) for layer in self.kv]
        return [LayerKV(layer[0], layer[1], scales[0], scales[1]) for layer, scales in zip(self.kv, self.scales)]

    def copy_block(self, src: int, dst: int) -> None:
        self.kv[:, :, dst] = self.kv[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]

    def copy_blocks(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """copy_block for each pair, in one gather and one scatter per tensor (the copy-on-write copies of a
        forward: 50 forks given their instructions copy 50 tail blocks). Indices: long tensors on the pool's
        device; targets are distinct and are none of the sources."""
        for tensor in (self.kv, self.scales) if self.scales is not None else (self.kv,):
            raw = tensor.view(torch.uint8)  # bytes: index_copy_ has no float8 kernels
            raw.index_copy_(2, targets, raw.index_select(2, sources))

    def export_blocks(self, block_ids: list[int], pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks' KV on the host, as bytes (exact for fp8 too): (kv [layers, 2, len(block_ids), block, kv_heads,
        head_dim * itemsize] uint8, scales [layers, 2, len(block_ids), block, kv_heads] float32 or None). pinned: in
        page-locked memory where the pool is on CUDA, so copying them back does not wait on the host."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        kv = self.kv.view(torch.uint8).index_select(2, ids).to("cpu")
        if pinned and self.kv.device.type == "cuda":
            kv = kv.pin_memory()
        scales = None if self.scales is None else self.scales.index_select(2, ids).to("cpu")
        return kv, scales

    def import_blocks(self, block_ids: list[int], exported: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Write what export_blocks returned (or a save file held, in the same layout) into the given blocks."""
        kv, scales = exported
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.view(torch.uint8).index_copy_(2, ids, kv.to(self.kv.device).view(torch.uint8))
        if scales is not None:
            self.scales.index_copy_(2, ids, scales.to(self.scales.device))

    def release(self) -> None:
        """Free the pool's memory now (Engine.close); the pool holds no block after this."""
        self.kv = self.kv.new_empty(0)
        self.scales = None

    def _poison_freed(self, block_ids: list[int]) -> None:
        """Poison blocks just freed, keeping their KV in the journal: a failed call that un-frees them needs it."""
        self.allocator.journal.log(self._restore_blocks, block_ids, self.kv[:, :, block_ids].clone(),
                                   None if self.scales is None else self.scales[:, :, block_ids].clone())
        self._poison(block_ids)

    def _poison(self, block_ids: list[int] | slice) -> None:
        self.kv[:, :, block_ids] = CANARY
        if self.scales is not None:  # a read of a freed fp8 block then dequantises to a glaring -416 * -416
            self.scales[:, :, block_ids] = CANARY

    def _restore_blocks(self, block_ids: list[int], kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        self.kv[:, :, block_ids] = kv
        if scales is not None:
            self.scales[:, :, block_ids] = scales

    def _untouched(self, block_ids: list[int]) -> bool:
        kv_untouched = bool((self.kv[:, :, block_ids] == CANARY).all())
        return kv_untouched and (self.scales is None or bool((self.scales[:, :, block_ids] == CANARY).all()))

    def _check_canaries(self, block_ids: list[int]) -> None:
        if not self._untouched(block_ids):
            raise AssertionError(f"KV canary broken: a free block among {block_ids[:8]} was written after it was freed")

    def verify_free_blocks(self) -> None:
        """With canaries on: every free block still holds the poison (nothing wrote into freed memory)."""
        free = self.allocator.free_blocks()
        if self.canaries and free:
            self._check_canaries(free)
