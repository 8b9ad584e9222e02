"""Plain-data snapshots of the tree and the block pool, for views, tests and users (no tensors)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from .kv import BranchTree


def tree_snapshot(tree: BranchTree) -> dict[str, Any]:
    nodes = [
        {
            "id": node.id,
            "parent": None if node.parent is None else node.parent.id,
            "start": node.start,  # sequence position of the node's first token
            "num_tokens": len(node.tokens),
            "tokens": list(node.tokens),
            "blocks": list(node.blocks),
            "children": [child.id for child in node.children],
            "branches": sorted(node.branch_names),
            # its KV is out of the pool (host memory, or dropped for recompute) until its branch grows again
            "preempted": node.swapped_blocks > 0,
            # no branch reaches it: kept for prefix reuse (Engine.prefix_cache), evicted when its blocks are needed
            "cached": node in tree.cache,
            # over the node's tokens sampled with generate(..., logprobs=True); None when it has none
            "mean_logprob": sum(node.logprobs.values()) / len(node.logprobs) if node.logprobs else None,
        }
        for node in tree.nodes()
    ]
    branches = {name: {"node": b.node.id, "num_tokens": len(b),
                       # the constraint it decodes under, e.g. "json_schema (Crossing)", and whether it is complete
                       "constraint": None if b.constraint is None else b.constraint.describe(),
                       "constraint_complete": b.matcher is not None and b.matcher.is_stopped()}
                for name, b in sorted(tree.branches.items())}
    return {"block_size": tree.block_size, "nodes": nodes, "branches": branches}


def block_snapshot(tree: BranchTree) -> dict[str, Any]:
    size, allocator = tree.block_size, tree.allocator
    tables = {name: list(tree.block_table(b.node)) for name, b in sorted(tree.branches.items())}
    readers = Counter(block for table in tables.values() for block in table)
    blocks = []
    for node in tree.nodes():
        first = node.start // size
        for offset, block in enumerate(node.blocks):
            logical = first + offset
            blocks.append({
                "id": block,
                "node": node.id,
                "logical_index": logical,
                "filled": min(size, node.end - logical * size),  # slots holding tokens of this node's path
                "refcount": allocator.refcount(block),
                "readers": readers[block],  # branches whose block table includes it
                # A node that starts mid-block got a private copy of its parent's partial block
                # when it first wrote (copy-on-write); that copy is its first block.
                "copy_on_write": offset == 0 and node.start % size != 0,
            })
    blocks.sort(key=lambda entry: entry["id"])
    return {"block_size": size, "num_blocks": allocator.num_blocks, "num_free": allocator.num_free,
            "blocks": blocks, "branches": tables}
