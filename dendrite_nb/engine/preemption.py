"""Making room in the KV pool: parking a branch's own blocks in host memory (or dropping them, to be recomputed),
bringing them back when it grows again, and choosing which branches make way for a decode step.

Only a leaf that one branch alone reads is parked (kv.BranchTree.preemptible): shared ancestors stay resident. The
bytes move through the pool's export_blocks / import_blocks; every change is logged in the call's journal first,
so a failed resume leaves the branch parked with its host copy, as it was.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

from ..errors import OutOfBlocks
from ..kv import AppendRecord, BranchTree, KVPool
from ..kv.journal import Journal, restore_attrs
from ..kv.tree import RECOMPUTE
from ..wording import counted
from .branch_state import Branch

RecomputeForward = Callable[[list[tuple[AppendRecord, list[int]]]], None]


class Preemption:
    """Parks and resumes branches' KV. recompute_forward writes a dropped node's KV again (the prefill's forward)."""

    def __init__(self, tree: BranchTree, pool: KVPool, journal: Journal, recompute_forward: RecomputeForward):
        self.tree, self.pool, self.journal = tree, pool, journal
        self.recompute_forward = recompute_forward
        # Preempted KV beyond this many host bytes is dropped and recomputed on resume (None: half the free RAM).
        self.host_memory_limit_bytes: int | None = None

    def preempt(self, branch: Branch) -> None:
        """Move the branch's own KV blocks to host memory (pinned on CUDA) and give them back to the pool; when
        host memory is short, drop them instead: resuming then recomputes them from the tokens."""
        node = branch.node
        self.journal.log(restore_attrs, node, {"swapped": node.swapped})
        if len(node.blocks) * self.pool.bytes_per_block > self.host_room_bytes():
            node.swapped = RECOMPUTE
        else:
            node.swapped = self.pool.export_blocks(node.blocks, pinned=True)
        self.tree.preempt(branch)

    def host_room_bytes(self) -> int:
        """Host memory preempted KV may take now: host_memory_limit_bytes, or half the memory available."""
        if self.host_memory_limit_bytes is not None:
            return self.host_memory_limit_bytes
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
            return 1 << 30

    def resume(self, branch: Branch) -> None:
        """Blocks for a preempted branch again, with its KV copied back byte for byte (or recomputed). The host
        copy is dropped only once the KV is back: if the copy or the recompute fails, the call's rollback
        leaves the branch preempted, with its host copy, as it was."""
        node = branch.node
        self.journal.log(restore_attrs, node, {"swapped": node.swapped})
        if node.swapped is RECOMPUTE:
            self._recompute(branch)
            return
        self.pool.import_blocks(self.tree.resume(node), node.swapped)
        node.swapped = None

    def resume_all(self, branches: Sequence[Branch]) -> None:
        for branch in branches:
            if branch.node.swapped_blocks:
                self.resume(branch)

    def _recompute(self, branch: Branch) -> None:
        """Write a dropped node's KV again with one forward over its tokens (ancestors stay resident)."""
        node, size = branch.node, self.pool.block_size
        self.tree.resume(node)
        if node.start % size:  # its first block also holds the parent's tail, copied as copy-on-write does
            self.pool.copy_block(self.tree.block_table(node.parent)[node.start // size], node.blocks[0])
        last_hidden = node.last_hidden
        self.journal.log(restore_attrs, node, {"last_hidden": last_hidden})
        record = AppendRecord(branch, node, node, False, 0, len(node.blocks), None, last_hidden)
        self.recompute_forward([(record, list(node.tokens))])
        node.last_hidden = last_hidden  # the saved state after the last token stays the one decoding used
        node.swapped = None

    def check_room(self, resolved: list[Branch], max_new_tokens: int) -> None:
        """Raise OutOfBlocks unless each branch could generate max_new_tokens with every other branch that can be
        preempted out of the way (generate preempts as it goes, so not all need fit at once)."""
        tree, free = self.tree, self.tree.num_available   # cached nodes are evicted before any branch is preempted
        needs = [tree.blocks_needed(b, max_new_tokens) for b in resolved]
        if sum(needs) <= free:
            return
        what = f"generating {counted(max_new_tokens, 'token')} on {counted(len(resolved), 'branch')}"
        reclaimable = sum(tree.preemptible(b) for b in tree.branches.values())
        for branch, need in zip(resolved, needs):
            room = free + reclaimable - tree.preemptible(branch)
            if need > room:
                raise OutOfBlocks(need, room, f"{what} (branch {branch.name!r} alone, the others preempted)")

    # ---- room for a decode step -------------------------------------------------------------------
    def fits(self, resolved: list[Branch], rows: Sequence[int]) -> bool:
        """Whether one decode step of `rows` fits the free blocks (and those cached nodes hold, evicted when
        needed). A resident row takes at most one block per token, so the per-row count runs only near a full
        pool or with preempted rows."""
        if len(rows) <= self.tree.allocator.num_free and not any(resolved[i].node.swapped_blocks for i in rows):
            return True
        return sum(self.tree.blocks_needed(resolved[i], 1) for i in rows) <= self.tree.num_available

    def fit(self, resolved: list[Branch], rows: list[int]) -> list[int]:
        """`rows`, or the part of them the pool holds after preempting (see make_room)."""
        if self.fits(resolved, rows):
            return rows
        return self.make_room(resolved, rows)

    def make_room(self, resolved: list[Branch], rows: list[int]) -> list[int]:
        """The rows of the next step that fit the pool, preempting what must make way: first branches
        outside this call, then the call's branches outside the step (lowest priority first of each), then
        the step's own lowest-priority rows. Shared ancestors are never preempted. Runs at a step boundary,
        where nothing awaits undo: each preemption is committed at once (it moves KV, it changes no branch's
        meaning), so a step that fails later keeps the room it made, and the blocks it frees can be reused."""
        tree = self.tree
        rows = list(rows)
        stepping, in_call = {id(resolved[i]) for i in rows}, {id(b) for b in resolved}
        victims = sorted((b for b in tree.branches.values() if id(b) not in stepping and tree.preemptible(b)),
                         key=lambda b: (id(b) in in_call, b.priority))
        while True:
            need = sum(tree.blocks_needed(resolved[i], 1) for i in rows)
            if need <= tree.num_available:   # cached nodes make way first (evicted as the step allocates)
                return rows
            if victims:
                self.preempt(victims.pop(0))
                self.journal.commit()
                continue
            dropped = min(rows, key=lambda i: resolved[i].priority)  # check_generate: one row alone always fits
            rows.remove(dropped)
            if tree.preemptible(resolved[dropped]):
                self.preempt(resolved[dropped])
                self.journal.commit()

