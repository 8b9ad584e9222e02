"""Block refcounts and the free list, in plain Python so it is unit-tested without torch.

A block's refcount is the number of tree nodes whose block list holds it. A block returns to the
free list exactly when that count reaches zero. Every change is logged in `journal` first (kv/journal.py),
so a failed engine call puts the refcounts and the free list back as they were.
"""
from __future__ import annotations

from collections import Counter, deque
from itertools import islice
from typing import Callable, Iterable

from ..errors import OutOfBlocks
from .journal import Journal

BlockHook = Callable[[list[int]], None]


class BlockAllocator:
    def __init__(self, num_blocks: int, on_allocate: BlockHook | None = None, on_free: BlockHook | None = None,
                 journal: Journal | None = None, on_give_back: BlockHook | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.journal = journal if journal is not None else Journal()
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._on_allocate = on_allocate  # e.g. verify canaries before a block is handed out
        self._on_free = on_free  # e.g. poison a block so a stale read is caught
        self._on_give_back = on_give_back  # the same for blocks an undo hands back (it must log nothing)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def allocate(self, count: int, what: str = "this operation") -> list[int]:
        """Take `count` blocks off the free list with refcount 1. Mutates nothing when it raises."""
        free = self._free
        if count > len(free):
            raise OutOfBlocks(count, len(free), what)
        block_ids = list(islice(free, count))
        self.journal.log(self._give_back, block_ids)
        for _ in range(count):
            free.popleft()
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
        block_ids = list(block_ids)
        self.journal.log(self._restore_refcounts, {b: self._refcounts[b] for b in block_ids})
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

    # ---- undo (journal entries): right however far the change they undo got -------------------------------
    def _give_back(self, block_ids: list[int]) -> None:
        """Undo of allocate: the blocks are free again, at the front of the list where they were."""
        on_list = set(self._free) if len(block_ids) > 1 else {b for b in block_ids if b in self._free}
        for block_id in block_ids:
            self._refcounts[block_id] = 0
        self._free.extendleft(b for b in reversed(block_ids) if b not in on_list)
        if self._on_give_back and block_ids:
            self._on_give_back(block_ids)

    def _restore_refcounts(self, counts: dict[int, int]) -> None:
        """Undo of decref: the old refcounts, and the blocks that were in use off the free list again."""
        back_in_use = {b for b, count in counts.items() if count > 0}
        for block_id, count in counts.items():
            self._refcounts[block_id] = count
        if back_in_use and any(b in back_in_use for b in self._free):
            self._free = deque(b for b in self._free if b not in back_in_use)

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
