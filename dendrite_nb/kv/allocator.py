"""Block refcounts and the free list, in plain Python so it is unit-tested without torch.

A block's refcount is the number of tree nodes whose block list holds it. A block returns to the
free list exactly when that count reaches zero.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Iterable

from ..errors import OutOfBlocks

BlockHook = Callable[[list[int]], None]


class BlockAllocator:
    def __init__(self, num_blocks: int, on_allocate: BlockHook | None = None, on_free: BlockHook | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._on_allocate = on_allocate  # e.g. verify canaries before a block is handed out
        self._on_free = on_free  # e.g. poison a block so a stale read is caught

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def allocate(self, count: int, what: str = "this operation") -> list[int]:
        """Take `count` blocks off the free list with refcount 1. Mutates nothing when it raises."""
        if count > len(self._free):
            raise OutOfBlocks(count, len(self._free), what)
        block_ids = [self._free.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._refcounts[block_id] = 1
        if self._on_allocate and block_ids:
            self._on_allocate(block_ids)
        return block_ids

    def incref(self, block_id: int) -> None:
        if self._refcounts[block_id] <= 0:
            raise RuntimeError(f"incref of free block {block_id}")
        self._refcounts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that went back to the free list."""
        freed = []
        for block_id in block_ids:
            count = self._refcounts[block_id]
            if count <= 0:
                raise RuntimeError(f"decref of free block {block_id}: a double free")
            self._refcounts[block_id] = count - 1
            if count == 1:
                freed.append(block_id)
        if freed:
            if self._on_free:
                self._on_free(freed)
            self._free.extend(freed)
        return freed

    def audit(self, held: Counter[int]) -> None:
        """Check refcounts against the references actually `held`; raises with the first mismatches."""
        problems = []
        for block_id, count in enumerate(self._refcounts):
            if count != held.get(block_id, 0):
                problems.append(f"block {block_id}: refcount {count}, held {held.get(block_id, 0)}")
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            problems.append("a block is on the free list twice")
        in_use = sum(1 for count in self._refcounts if count > 0)
        if in_use + len(self._free) != self.num_blocks:
            problems.append(f"{in_use} in use + {len(self._free)} free != {self.num_blocks} blocks")
        for block_id in free_set:
            if self._refcounts[block_id] != 0:
                problems.append(f"block {block_id} is free with refcount {self._refcounts[block_id]}")
        if problems:
            raise AssertionError("KV block audit failed: " + "; ".join(problems[:10]))
