"""The nodes no branch reaches any more, kept with their KV so that a later prompt can reuse it (prefix_cache).

Plain Python, no torch. The tree (kv/tree.py) decides when a node joins (a prune or rewind leaves it unreached while
prefix_cache is on) and leaves (a prompt matches it, or an allocation evicts it). This holds the set, the count of
blocks its nodes hold (each block is held by one node, so evicting them frees exactly that many), and the order of
eviction: least recently used leaves first (Node.last_use), a parent once its last child is gone.

A cached node's descendants are all cached (nothing under it is reached), and a cached node never changes: no
branch appends to it. Every change is logged in the call's journal first (kv/journal.py).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterator

from .journal import Journal

if TYPE_CHECKING:   # tree.py imports this module
    from .tree import Node


class NodeCache:
    __slots__ = ("nodes", "num_blocks", "journal")

    def __init__(self, journal: Journal):
        self.nodes: set[Node] = set()
        self.num_blocks = 0   # blocks the cached nodes hold
        self.journal = journal

    def __contains__(self, node: Node) -> bool:
        return node in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node: Node) -> None:
        self.journal.log(self._put, node, node in self.nodes)
        self._put(node, True)

    def remove(self, node: Node) -> None:
        self.journal.log(self._put, node, node in self.nodes)
        self._put(node, False)

    def _put(self, node: Node, cached: bool) -> None:
        """`node` in the cache or not, its blocks counted with it; right however often it runs (also an undo)."""
        if cached == (node in self.nodes):
            return
        if cached:
            self.nodes.add(node)
            self.num_blocks += len(node.blocks)
        else:
            self.nodes.discard(node)
            self.num_blocks -= len(node.blocks)

    def least_recently_used(self) -> Iterator[Node]:
        """Cached leaves, least recently used first, for the caller to evict one by one: a cached parent joins
        once the caller has evicted its last child. O(k log k) for k cached leaves, paid only under pressure."""
        heap = [(node.last_use, node.id, node) for node in self.nodes if not node.children]
        heapq.heapify(heap)   # ids are unique, so a tie never compares two nodes
        while heap:
            node = heapq.heappop(heap)[2]
            if node not in self.nodes or node.children:
                continue
            parent = node.parent
            yield node
            if parent is not None and parent in self.nodes and not parent.children:
                heapq.heappush(heap, (parent.last_use, parent.id, parent))
