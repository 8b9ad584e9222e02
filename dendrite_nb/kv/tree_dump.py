"""A branch tree as plain data (BranchTree.dump and BranchTree.load), and what a dump must satisfy to be loaded.

What a save file records of the tree: each node's place, tokens, blocks and log-probabilities, the id the next
node gets, and which node each branch names. Nothing the engine hangs on nodes and branches is in it (a node's
last hidden state and host copy of parked KV, a branch's decode state): dump returns the live nodes beside the
data and load returns the nodes it made, so the caller carries those through the nodes' public fields.

Plain Python, no torch. check_dump refuses, before load changes anything, every dump that would not make a tree
BranchTree.audit accepts, so whatever loads is consistent.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:   # tree.py imports this module
    from .tree import BranchTree


@dataclass(slots=True)
class SavedNode:
    id: int
    parent: int  # index in TreeDump.nodes of the parent, an earlier entry; -1 for the root
    start: int  # sequence position of the first token: the parent's end
    tokens: list[int]
    blocks: list[int]  # physical block ids, in logical order (the allocator's refcounts count them)
    preempted: int = 0  # blocks parked outside the pool (Node.swapped_blocks); a preempted node holds none
    logprobs: dict[int, float] = field(default_factory=dict)  # by index in `tokens`

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(slots=True)
class TreeDump:
    nodes: list[SavedNode]  # every node but the root, each after its parent
    branches: dict[str, int]  # branch name -> index in `nodes` of its node; -1 for the root
    next_node_id: int  # the id the tree gives the next node it makes


def check_dump(tree: BranchTree, dump: TreeDump, branch_state: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise ValueError (BranchExists for a name given twice) unless `tree` is empty and loading `dump` into it,
    with `branch_state` for the branches named in it, makes a tree that audit() accepts."""
    if tree.branches or tree.root.children:
        raise ValueError(f"load needs an empty tree, but this one holds {len(tree.branches):,} branches; load into a "
                         f"new BranchTree.")
    size, ends, ids = tree.block_size, [], set()
    held: Counter[int] = Counter()
    children: Counter[int] = Counter(saved.parent for saved in dump.nodes)
    readers: Counter[int] = Counter(dump.branches.values())
    for index, saved in enumerate(dump.nodes):
        where = f"node {index} (id {saved.id!r})"
        if not isinstance(saved.id, int) or saved.id < 1 or saved.id in ids:
            raise ValueError(f"{where}: a node id must be an int >= 1 that no other node has.")
        ids.add(saved.id)
        if not isinstance(saved.parent, int) or not -1 <= saved.parent < index:
            raise ValueError(f"{where}: its parent must be -1 (the root) or an earlier node's index, got "
                             f"{saved.parent!r}; list each node after its parent.")
        parent_end = ends[saved.parent] if saved.parent >= 0 else 0
        if saved.start != parent_end:
            raise ValueError(f"{where} starts at {saved.start!r}; it must start where its parent ends, "
                             f"{parent_end:,}.")
        spans = -(-saved.end // size) - saved.start // size
        if not isinstance(saved.preempted, int) or saved.preempted < 0 or (saved.preempted and saved.blocks):
            raise ValueError(f"{where}: preempted must be 0 or, for a node holding no blocks, the count parked.")
        if len(saved.blocks) + saved.preempted != spans:
            raise ValueError(f"{where}: {len(saved.tokens):,} tokens from position {saved.start:,} take {spans:,} "
                             f"blocks of {size}, but it holds {len(saved.blocks):,} and has {saved.preempted:,} "
                             f"parked.")
        if saved.preempted and children[index]:
            raise ValueError(f"{where} is preempted, which only a node without children can be.")
        if not children[index] and not readers[index]:
            raise ValueError(f"{where} is no branch's node and no node's parent: nothing would reach it.")
        if any(not 0 <= i < len(saved.tokens) for i in saved.logprobs):
            raise ValueError(f"{where} holds log-probabilities past its {len(saved.tokens):,} tokens.")
        held.update(saved.blocks)
        ends.append(saved.end)
    if not isinstance(dump.next_node_id, int) or dump.next_node_id <= max(ids, default=0):
        raise ValueError(f"next_node_id must be an int past every node's id ({max(ids, default=0):,}), "
                         f"got {dump.next_node_id!r}.")
    _check_blocks(tree, held)
    tree.check_new_names(list(dump.branches))
    for name, index in dump.branches.items():
        if not isinstance(index, int) or not -1 <= index < len(dump.nodes):
            raise ValueError(f"branch {name!r} names node {index!r}; expected -1 (the root) to {len(dump.nodes) - 1}.")
    unknown = [name for name in branch_state if name not in dump.branches]
    if unknown:
        raise ValueError(f"branch_state names {unknown[0]!r}, which is no branch of the dump.")


def _check_blocks(tree: BranchTree, held: Counter[int]) -> None:
    """The dump's nodes hold exactly the blocks in use, each as many times as its refcount says: the caller
    allocated them for this load and nothing else holds a block."""
    allocator = tree.allocator
    outside = [block for block in held if not isinstance(block, int) or not 0 <= block < allocator.num_blocks]
    if outside:
        raise ValueError(f"block {outside[0]!r} is no block of the pool (0 to {allocator.num_blocks - 1:,}).")
    wrong = [block for block, count in held.items() if allocator.refcount(block) != count]
    if wrong:
        block = wrong[0]
        raise ValueError(f"block {block} is held {held[block]} times in the dump but has refcount "
                         f"{allocator.refcount(block)}; allocate each block the dump holds (and no other) first.")
    in_use = allocator.num_blocks - allocator.num_free
    if in_use != len(held):
        raise ValueError(f"{in_use:,} blocks are in use but the dump holds {len(held):,}; allocate each block the "
                         f"dump holds (and no other) first.")
