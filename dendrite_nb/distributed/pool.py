"""Rank 0's KV pool in a tensor-parallel engine: its own KV heads' shard, whose allocator is the only one.

Each worker's pool holds its KV heads under the same block ids; every change rank 0 makes to block contents outside
a forward is mirrored here, so that no caller needs to know the pool is split: copy-on-write copies (the forward's,
prefix reuse's, rewind's and recompute's) go to every rank, and exported blocks come back with every rank's heads,
in the layout of a whole pool (kv heads in rank order), so that what preemption parks in host memory is the same as
a one-process engine's. Importing splits such blocks by heads again.
"""
from __future__ import annotations

import torch

from ..kv.pool import KVPool
from .group import TensorGroup

HEAD_DIM = 4  # of an exported kv [layers, 2, blocks, block_size, kv_heads, head bytes] and scales [..., kv_heads]


class ShardedKVPool(KVPool):
    def __init__(self, group: TensorGroup, **sizes):
        super().__init__(**sizes)
        self.group = group
        # Over all ranks: what a block exported to host memory takes, and the engine's kv_bytes.
        self.bytes_per_block *= group.world

    def copy_block(self, src: int, dst: int) -> None:
        self.group.command("copy", [(src, dst)])
        super().copy_block(src, dst)

    def copy_blocks(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        self.group.command("copy", list(zip(sources.tolist(), targets.tolist())))
        super().copy_blocks(sources, targets)

    def export_blocks(self, block_ids: list[int], pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks' KV with every rank's heads, as a one-process pool exports them."""
        self.group.command("export", list(block_ids))
        with self.group.lockstep("exporting KV blocks"):
            kv, scales = super().export_blocks(block_ids)
            kv = torch.cat(self.group.gather(kv), dim=HEAD_DIM)
            if scales is not None:
                scales = torch.cat(self.group.gather(scales), dim=HEAD_DIM)
        if pinned and self.kv.device.type == "cuda":
            kv = kv.pin_memory()
        return kv, scales

    def import_blocks(self, block_ids: list[int], exported: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Blocks exported with every rank's heads: each rank takes its own."""
        kv, scales = exported
        world = self.group.world
        kv_parts = [part.contiguous() for part in kv.view(torch.uint8).chunk(world, dim=HEAD_DIM)]
        scale_parts = None if scales is None else [part.contiguous() for part in scales.float().chunk(world, dim=HEAD_DIM)]
        self.group.command("import", list(block_ids), tuple(kv_parts[0].shape),
                           None if scale_parts is None else tuple(scale_parts[0].shape))
        with self.group.lockstep("importing KV blocks"):
            mine = torch.empty_like(kv_parts[0])
            self.group.scatter(kv_parts, mine)
            my_scales = None
            if scale_parts is not None:
                my_scales = torch.empty_like(scale_parts[0])
                self.group.scatter(scale_parts, my_scales)
            super().import_blocks(block_ids, (mine, my_scales))
