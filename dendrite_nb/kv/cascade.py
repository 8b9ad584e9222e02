"""Cut a decode batch's contexts into KV segments, so each shared tree node is read once per step (and a
prefill's of several sequences, whose rows are the leaves their new tokens went to: forward.py).

Plain Python, no torch. Rows of a decode batch are leaves of the branch tree; every node on a row's path
is a run of positions [node.start, node.end) that all rows under the node share. A node read by two or
more rows, long enough for sharing to pay, becomes one shared segment (a kernel reads its KV once for
all those rows and merges the partial results by log-sum-exp). Everything else a row reads joins the
row's private segments, read as flat paged attention would. Any tree depth works: a row's segments are
its shared ancestors, outermost first, with private runs between and after them.
"""
from __future__ import annotations

from typing import Sequence

from .layout import BatchLayout, KVSegment
from .tree import Branch, BranchTree, Node

# Below this many tokens a shared node is read per row instead: one more partial result per row to
# merge costs about as much as re-reading a few blocks (see benchmarks/tree_attention.py).
MIN_SHARED_TOKENS = 64


def build_segments(tree: BranchTree, leaves: Sequence[Node], tables: Sequence[Sequence[int]],
                   min_shared_tokens: int = MIN_SHARED_TOKENS) -> list[KVSegment]:
    """Segments covering each row's context [0, leaves[row].end) exactly once. `tables[row]` is the row's
    block table (tree.block_table(leaves[row])). Rows must be distinct leaves (a decode step gives each
    branch its own node); reads the tree, changes nothing."""
    size = tree.block_size
    paths: list[list[Node]] = []
    readers: dict[int, list[int]] = {}  # node id -> rows whose path holds it
    nodes: dict[int, Node] = {}
    root = tree.root
    for row, leaf in enumerate(leaves):
        path, node = [], leaf
        while node is not root:
            path.append(node)
            rows = readers.get(node.id)
            if rows is None:
                readers[node.id], nodes[node.id] = [row], node
            else:
                rows.append(row)
            node = node.parent
        path.reverse()
        paths.append(path)
    shared_ids = {node_id for node_id, rows in readers.items()  # read by two rows or more, and long enough
                  if len(rows) >= 2 and len(nodes[node_id].tokens) >= min_shared_tokens}

    shared: dict[int, list] = {}  # id of a segment's first node -> [rows, start, end, deepest node]
    segments: list[KVSegment] = []
    for row, path in enumerate(paths):
        run_start = None  # start of the private run being gathered
        previous = None  # the shared segment just before, which an identical-readers node extends
        for node in path:
            if node.id not in shared_ids:
                run_start = node.start if run_start is None else run_start
                previous = None
                continue
            if run_start is not None:
                segments.append(_segment((row,), run_start, node.start, tables[row], size))
                run_start = None
            rows = readers[node.id]
            if previous is not None and previous[0] == rows:   # a chain read by the same rows: one segment
                previous[2], previous[3] = node.end, node
                shared[node.id] = previous
                continue
            previous = shared.get(node.id)
            if previous is None:
                previous = shared[node.id] = [rows, node.start, node.end, node]
        if run_start is not None:
            segments.append(_segment((row,), run_start, path[-1].end, tables[row], size))
    unique = {id(entry): entry for entry in shared.values()}   # a merged chain is listed under each of its nodes
    for rows, start, end, deepest in unique.values():
        segments.append(_segment(tuple(rows), start, end, tree.block_table(deepest), size))
    return segments


class SegmentCache:
    """build_segments for the steps of one generation: while the rows are the same leaves, every segment
    but each row's last (its private run up to the growing leaf end) is unchanged, because a node with
    children never changes. Rebuilding only those last runs makes a step O(rows), not O(tree)."""

    def __init__(self, min_shared_tokens: int = MIN_SHARED_TOKENS):
        self.min_shared_tokens = min_shared_tokens
        self._key: tuple[int, ...] | None = None
        self._fixed: list[KVSegment] = []
        self._last_starts: list[int] = []  # per row, where its final private run starts

    def segments(self, tree: BranchTree, leaves: Sequence[Node], tables: Sequence[Sequence[int]]) -> list[KVSegment]:
        key = tuple(node.id for node in leaves)
        if key != self._key:
            built = build_segments(tree, leaves, tables, self.min_shared_tokens)
            last = {seg.rows[0]: seg for seg in built if len(seg.rows) == 1 and seg.end == leaves[seg.rows[0]].end}
            self._fixed = [seg for seg in built if not (len(seg.rows) == 1 and last.get(seg.rows[0]) is seg)]
            self._last_starts = [last[row].start for row in range(len(leaves))]
            self._key = key
            return built
        size = tree.block_size
        last = []
        for row, (start, leaf, table) in enumerate(zip(self._last_starts, leaves, tables)):  # _segment, inlined
            end = leaf.start + len(leaf.tokens)
            last.append(KVSegment((row,), start, end, tuple(table[start // size: (end - 1) // size + 1])))
        return self._fixed + last


def _segment(rows: tuple[int, ...], start: int, end: int, table: Sequence[int], size: int) -> KVSegment:
    return KVSegment(rows, start, end, tuple(table[start // size: (end - 1) // size + 1]))


def decode_layout(tree: BranchTree, branches: Sequence[Branch], shared: bool = True,
                  min_shared_tokens: int = MIN_SHARED_TOKENS) -> BatchLayout:
    """The attention layout of one decode step in which each branch's last token is the query over its
    whole context (what a step sees right after appending). shared=False leaves segments None (flat)."""
    leaves = [b.node for b in branches]
    if len({id(n) for n in leaves}) != len(leaves):
        raise ValueError("two branches point at one node; a decode step gives each row its own leaf.")
    tables = [tree.block_table(n) for n in leaves]
    segments = build_segments(tree, leaves, tables, min_shared_tokens) if shared else None
    return BatchLayout(q_lens=[1] * len(leaves), kv_lens=[n.end for n in leaves], block_tables=tables,
                       segments=segments)
