"""Prefix reuse on the branch tree: the longest run of a prompt that the tree holds already below a branch's node,
a node split where such a run ends inside it, and a branch moved back to an earlier length.

Plain Python, no torch. The engine (engine/prefix_reuse.py) copies the KV block a split asks for; everything else
is bookkeeping, each change logged in the call's journal first (kv/journal.py).

A split of node X at offset p keeps X as the first p tokens (X1) and makes a new node X2 of the rest, with X's
children, branch names, last hidden state and cache membership. X2 keeps every block X held from the one holding
position X.start + p on, so every table below X is unchanged (the cached tables of the leaves under it, the decode
loop's segments). When that position is not block-aligned, its block holds tokens of both halves: X1 gets a copy
of it (copy-on-write, made by the caller), so each block stays held by one node.
"""
from __future__ import annotations

from typing import NamedTuple

from .journal import restore_attrs
from .tree import Branch, BranchTree, Node

BlockCopy = tuple[int, int]   # (source, target) block: the caller copies the KV before anything reads the target


class Match(NamedTuple):
    """Where a prompt's longest known run ends, below the node it was matched from."""
    path: list[Node]   # the nodes it runs through, outermost first; all of the last one's tokens may not match
    matched: int       # prompt tokens the tree holds


def longest_match(tree: BranchTree, node: Node, tokens: list[int]) -> Match:
    """The longest run of `tokens` held by a chain of `node`'s descendants (preempted ones left out: their KV is out
    of the pool). At each node, the child whose tokens share the longest run with what is left. Reads the tree;
    costs O(tokens compared + children looked at), never O(tree)."""
    path: list[Node] = []
    matched = 0
    while matched < len(tokens):
        first, best, best_run = tokens[matched], None, 0
        for child in node.children:
            if child.tokens and child.tokens[0] == first and not child.swapped_blocks:
                run = _common_run(child.tokens, tokens, matched)
                if run > best_run:
                    best, best_run = child, run
        if best is None:
            break
        path.append(best)
        matched += best_run
        if best_run < len(best.tokens):
            break
        node = best
    return Match(path, matched)


def _common_run(held: list[int], tokens: list[int], at: int) -> int:
    """How many of `held` equal tokens[at:] from the start."""
    length = min(len(held), len(tokens) - at)
    if held[:length] == tokens[at: at + length]:   # the usual case, compared in C
        return length
    count = 0
    for a, b in zip(held, tokens[at: at + length]):
        if a != b:
            break
        count += 1
    return count


def locate(path: list[Node], end: int) -> tuple[Node, int] | None:
    """The node of `path` holding sequence position end - 1 and how many of its tokens come before `end`, or None
    when `end` is not past the path's start."""
    for node in reversed(path):
        if node.start < end:
            return node, end - node.start
    return None


def split(tree: BranchTree, node: Node, offset: int) -> tuple[Node, BlockCopy | None]:
    """Split `node` after `offset` of its tokens (0 < offset < its length): it keeps them, a new child takes the
    rest with everything hanging below (see the module docstring). Returns the new node and the block copy the
    caller must make, or None at a block boundary. Raises OutOfBlocks (when that copy finds no block) or
    ValueError before changing anything."""
    if not 0 < offset < len(node.tokens) or node is tree.root or node.swapped_blocks:
        raise ValueError(f"cannot split node {node.id} ({len(node.tokens)} tokens"
                         f"{', preempted' if node.swapped_blocks else ''}) after {offset} tokens")
    size, at = tree.block_size, node.start + offset
    first_tail = at // size - node.start // size   # index in node.blocks of the block holding position `at`
    cached = node in tree.cache
    if cached:   # out of the cache while the copy is allocated: evicting it then would lose what is split
        tree.cache.remove(node)
    copy = tree.take_blocks(1, "splitting a node at a shared prefix")[0] if at % size else None
    tree.journal.log(_unsplit, tree, node, {
        "tokens": node.tokens, "blocks": node.blocks, "children": node.children,
        "branch_names": node.branch_names, "last_hidden": node.last_hidden, "logprobs": node.logprobs,
        "path_cache": node.path_cache, "leaf_table": node.leaf_table})
    # Copies of what the undo keeps, so that nothing done to the new node later can reach into it.
    tail = Node(id=tree._next_node_id, parent=node, start=at, tokens=node.tokens[offset:],
                blocks=node.blocks[first_tail:], children=list(node.children), branch_names=set(node.branch_names),
                last_hidden=node.last_hidden, path_cache=dict(node.path_cache), last_use=node.last_use,
                logprobs={i - offset: lp for i, lp in node.logprobs.items() if i >= offset} or None
                if node.logprobs else None)
    tree._next_node_id += 1
    for child in tail.children:
        child.parent = tail
    for name in tail.branch_names:
        tree.branches[name].node = tail
    node.tokens, node.children, node.branch_names = node.tokens[:offset], [tail], set()
    node.blocks = node.blocks[:first_tail] + ([copy] if copy is not None else [])
    node.logprobs = {i: lp for i, lp in node.logprobs.items() if i < offset} or None if node.logprobs else None
    node.last_hidden, node.path_cache, node.leaf_table = None, {}, None
    if cached:
        tree.cache.add(node)
    if not tail.branch_names and all(child in tree.cache for child in tail.children):   # nothing reaches it
        tree.cache.add(tail)
    return tail, None if copy is None else (tail.blocks[0], copy)


def reuse(tree: BranchTree, branch: Branch, tokens: list[int]) -> tuple[int, BlockCopy | None]:
    """Move the branch down over the longest run of `tokens` that the tree holds below its node, splitting the
    node where the run ends inside one; the caller then prefills only the tokens past it. The branch's node must
    not be one it extends in place (those tokens would go into the node itself, not below it).

    At least one token is left to prefill (the hidden state after the last one is what the next decode step
    reads), unless the run ends at the end of a node that holds that state. A split that is not block-aligned
    needs a block for its copy: when the pool could not hold that block and the rest of the prompt, the run is
    cut back to the block boundary instead. Cached nodes the run goes through leave the cache and are stamped
    used. Returns how many tokens the branch moved over and the block copy the caller must make."""
    start, size = branch.node, tree.block_size
    path, matched = longest_match(tree, start, tokens)
    if not matched:
        return 0, None
    base = start.end
    end = base + matched
    if matched == len(tokens) and not (end == path[-1].end and path[-1].last_hidden is not None):
        end -= 1
    found = locate(path, end)
    if found is not None and found[1] < len(found[0].tokens) and end % size:
        used = path[: path.index(found[0]) + 1]
        available = tree.num_available - sum(len(node.blocks) for node in used if node in tree.cache)
        rest = base + len(tokens) - end
        if 1 + -(-(end + rest) // size) - end // size > available:   # the split's copy, then the rest's blocks
            end -= end % size
            found = locate(path, end)
    if found is None:
        return 0, None
    node, offset = found
    tree.clock += 1
    for used in path[: path.index(node) + 1]:
        if used in tree.cache:
            tree.cache.remove(used)
        tree.journal.log(restore_attrs, used, {"last_use": used.last_use})
        used.last_use = tree.clock
    copy = split(tree, node, offset)[1] if offset < len(node.tokens) else None
    tree.move(branch, node)
    return end - base, copy


def _unsplit(tree: BranchTree, node: Node, fields: dict) -> None:
    """Undo of split: the node whole again, its children and branches back on it (the new node is dropped)."""
    restore_attrs(node, fields)
    for child in node.children:
        child.parent = node
    for name in node.branch_names:
        branch = tree.branches.get(name)
        if branch is not None:
            branch.node = node


def rewind(tree: BranchTree, branch: Branch, num_tokens: int) -> tuple[list[int], BlockCopy | None]:
    """Move the branch back to its first `num_tokens` tokens (fewer than it holds; the node holding the last of
    them resident). The nodes no branch reaches any more are collected, or kept as cache with prefix_cache on. A
    node cut in the middle is split (a block copy when the cut is not block-aligned), except a leaf only this
    branch names when nothing is to be kept of the rest: that one is cut in place. Returns the blocks freed and
    the block copy to make. Raises OutOfBlocks before changing anything."""
    node = branch.node
    if not 0 <= num_tokens < node.end or (node.swapped_blocks and num_tokens > node.start):
        raise ValueError(f"cannot rewind branch {branch.name!r} of {node.end} tokens"
                         f"{' (preempted)' if node.swapped_blocks else ''} to {num_tokens}")
    target = node
    while target is not tree.root and target.start >= num_tokens:
        target = target.parent
    copy = None
    if target is not tree.root and num_tokens < target.end:
        offset = num_tokens - target.start
        alone = target is node and not node.children and node.branch_names == {branch.name}
        keep_rest = tree.prefix_cache and (num_tokens % tree.block_size == 0 or tree.num_available >= 1)
        if alone and not keep_rest:
            return _cut(tree, node, offset), None
        copy = split(tree, target, offset)[1]
    left = branch.node   # the split moved the branch's name to the new node when it cut the branch's own node
    tree.move(branch, target)
    return tree.release(left), copy


def _cut(tree: BranchTree, node: Node, offset: int) -> list[int]:
    """Keep only the first `offset` tokens of a leaf that one branch alone names; returns the blocks freed."""
    kept_blocks = -(-(node.start + offset) // tree.block_size) - node.start // tree.block_size
    tree.journal.log(restore_attrs, node, {"tokens": list(node.tokens), "blocks": list(node.blocks),
                                           "logprobs": dict(node.logprobs) if node.logprobs else None,
                                           "last_hidden": node.last_hidden})
    dropped = node.blocks[kept_blocks:]
    node.cut(offset, kept_blocks)
    node.last_hidden = None   # the state after the new last token is not known: the engine computes it again
    return tree.allocator.decref(dropped)
