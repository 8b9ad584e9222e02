"""Prefix reuse on the tree alone (kv/prefix.py, kv/node_cache.py): matching a prompt against what the tree holds,
splitting a node where a match ends inside it, rewinding a branch, and the cache of nodes no branch reaches.
Plain Python, no model: the engine's part (the KV copy, the logits) is tests/engine/test_prefix_reuse.py's."""
import pytest

from dendrite_nb.errors import OutOfBlocks
from dendrite_nb.kv import BlockAllocator, BranchTree
from dendrite_nb.kv.prefix import longest_match, reuse, rewind, split

BLOCK = 4
HIDDEN = "hidden"   # stands for the engine's last hidden state: reuse only reads whether a node has one


def make_tree(num_blocks=32, cache=False):
    tree = BranchTree(BlockAllocator(num_blocks), BLOCK)
    tree.prefix_cache = cache
    return tree


def grow(tree, branch, tokens):
    """Append as the engine's prefill does: the node the tokens went into then holds a last hidden state."""
    record = tree.append(branch, tokens)
    record.node.last_hidden = HIDDEN
    return record.node


def state(tree):
    nodes = [(n.id, n.start, tuple(n.tokens), tuple(n.blocks), tuple(sorted(n.branch_names)), n in tree.cache)
             for n in tree.nodes()]
    return nodes, tree.allocator.num_free, tree.cache.num_blocks, {n: b.node.id for n, b in tree.branches.items()}


def tables(tree):
    return {name: list(tree.block_table(b.node)) for name, b in tree.branches.items()}


def test_the_longest_match_walks_only_the_path_it_matches():
    tree = make_tree()
    a = tree.add_branch("a")
    grow(tree, a, [1, 2, 3, 4, 5, 6])
    (b,) = tree.fork(a, ["b"])
    grow(tree, b, [7, 8, 9])
    (c,) = tree.fork(a, ["c"])
    grow(tree, c, [7, 8, 10, 11])
    path, matched = longest_match(tree, tree.root, [1, 2, 3, 4, 5, 6, 7, 8, 10, 99])
    assert path == [a.node, c.node] and matched == 9   # of the two children starting with 7, the longer run
    path, matched = longest_match(tree, tree.root, [1, 2, 3, 9])
    assert path == [a.node] and matched == 3
    assert longest_match(tree, tree.root, [2, 3]) == ([], 0)


def test_a_preempted_node_is_not_matched():
    tree = make_tree()
    a = tree.add_branch("a")
    grow(tree, a, [1, 2, 3])
    (b,) = tree.fork(a, ["b"])
    grow(tree, b, [4, 5])
    tree.preempt(b)
    assert longest_match(tree, tree.root, [1, 2, 3, 4, 5]) == ([a.node], 3)


@pytest.mark.parametrize("offset, copies", [(4, False), (6, True), (1, True)])
def test_a_split_keeps_every_table_below_and_every_block_held_once(offset, copies):
    tree = make_tree()
    a = tree.add_branch("a")
    node = grow(tree, a, list(range(1, 11)))   # 10 tokens, 3 blocks
    (b,) = tree.fork(a, ["b"])
    grow(tree, b, [20, 21])
    before_tables, blocks = tables(tree), list(node.blocks)
    tail, copy = split(tree, node, offset)
    assert node.tokens == list(range(1, offset + 1)) and tail.tokens == list(range(offset + 1, 11))
    assert node.children == [tail] and tail.parent is node and b.node.parent is tail
    assert a.node is tail and tail.last_hidden == HIDDEN and node.last_hidden is None and not node.branch_names
    assert tables(tree) == before_tables   # the tail keeps its blocks: nothing below is re-pointed
    first_tail = offset // BLOCK
    assert tail.blocks == blocks[first_tail:]
    if copies:   # the block at the split holds tokens of both halves: the first half gets a copy
        assert copy == (blocks[first_tail], node.blocks[-1]) and node.blocks[:-1] == blocks[:first_tail]
    else:
        assert copy is None and node.blocks == blocks[:first_tail]
    assert tree.block_table(node)[: -(-offset // BLOCK)] == blocks[:first_tail] + ([copy[1]] if copies else [])
    tree.audit()


def test_a_split_that_finds_no_block_for_its_copy_changes_nothing():
    tree = make_tree(num_blocks=3)
    a = tree.add_branch("a")
    node = grow(tree, a, list(range(1, 13)))   # the whole pool
    before = state(tree)
    with pytest.raises(OutOfBlocks):
        split(tree, node, 6)
    assert state(tree) == before
    tail, copy = split(tree, node, 8)   # block-aligned: no copy, so no block needed
    assert copy is None and node.blocks and tail.blocks
    tree.audit()


def test_a_split_is_undone_by_the_journal():
    tree = make_tree()
    a = tree.add_branch("a")
    node = grow(tree, a, list(range(1, 11)))
    (b,) = tree.fork(a, ["b"])
    grow(tree, b, [20])
    node.logprobs = {2: -0.5, 8: -1.5}
    before, logprobs, table = state(tree), dict(node.logprobs), tables(tree)
    mark = tree.journal.mark()
    tail, _ = split(tree, node, 5)
    assert node.logprobs == {2: -0.5} and tail.logprobs == {3: -1.5}
    tree.journal.rollback(mark)
    assert state(tree) == before and node.logprobs == logprobs and a.node is node and tables(tree) == table
    assert node.last_hidden == HIDDEN and b.node.parent is node
    tree.audit()


def test_reuse_leaves_the_last_token_unless_the_tree_holds_the_state_after_it():
    tree = make_tree()
    a = tree.add_branch("a")
    grow(tree, a, list(range(1, 11)))
    b = tree.add_branch("b")
    assert reuse(tree, b, list(range(1, 11))) == (10, None) and b.node is a.node   # ends where a's state is
    c = tree.add_branch("c")
    count, copy = reuse(tree, c, list(range(1, 8)))   # ends inside a's node: split before its last token
    assert count == 6 and copy is not None and c.node.tokens == list(range(1, 7)) and c.node.end == 6
    d = tree.add_branch("d")
    assert reuse(tree, d, list(range(1, 7)))[0] == 5   # the end of a node with no state: one token left
    tree.audit()


def test_reuse_stops_at_a_block_boundary_when_the_pool_has_no_block_for_the_copy():
    tree = make_tree(num_blocks=4)
    a = tree.add_branch("a")
    grow(tree, a, list(range(1, 13)))   # 3 blocks; one left
    b = tree.add_branch("b")
    count, copy = reuse(tree, b, list(range(1, 8)) + [50])   # 7 match; a copy and the rest would need 2 blocks
    assert (count, copy) == (4, None) and b.node.end == 4
    tree.audit()


def test_rewind_cuts_a_branch_s_own_leaf_in_place_and_frees_the_rest():
    tree = make_tree()
    a = tree.add_branch("a")
    node = grow(tree, a, list(range(1, 11)))
    free = tree.allocator.num_free
    freed, copy = rewind(tree, a, 5)
    assert copy is None and a.node is node and node.tokens == [1, 2, 3, 4, 5] and len(freed) == 1
    assert tree.allocator.num_free == free + 1 and node.last_hidden is None
    tree.audit()


def test_rewind_into_a_shared_node_splits_it_and_collects_what_is_left():
    tree = make_tree()
    a = tree.add_branch("a")
    grow(tree, a, list(range(1, 11)))
    (b,) = tree.fork(a, ["b"])
    leaf = grow(tree, b, [20, 21, 22])
    freed, copy = rewind(tree, b, 7)
    assert b.node.tokens == list(range(1, 8)) and copy is not None and leaf.parent is None   # collected
    assert len(freed) == 2   # the leaf's own blocks: its copy of the block at 8 and the next
    assert a.node.parent is b.node and tree.path_tokens(a.node) == list(range(1, 11))
    assert rewind(tree, b, 0)[1] is None and b.node is tree.root
    tree.audit()


def test_prune_with_the_cache_on_keeps_the_nodes_and_a_later_prompt_reuses_them():
    tree = make_tree(cache=True)
    a = tree.add_branch("a")
    grow(tree, a, list(range(1, 11)))
    (b,) = tree.fork(a, ["b"])
    leaf = grow(tree, b, [20, 21])
    free = tree.allocator.num_free
    assert tree.prune(b) == [] and leaf in tree.cache and tree.allocator.num_free == free
    assert tree.cache.num_blocks == len(leaf.blocks) and tree.num_available == free + len(leaf.blocks)
    tree.audit()
    c = tree.add_branch("c")
    assert reuse(tree, c, list(range(1, 11)) + [20, 21])[0] == 12 and c.node is leaf and leaf not in tree.cache
    assert tree.cache.num_blocks == 0
    tree.audit()


def test_eviction_takes_the_least_recently_used_cached_leaves_first_and_never_a_reached_node():
    tree = make_tree(num_blocks=8, cache=True)
    root = tree.add_branch("root")
    grow(tree, root, [1, 2, 3, 4])   # 1 block
    leaves = {}
    for name, token in [("old", 10), ("mid", 11), ("new", 12)]:
        (child,) = tree.fork(root, [name])
        leaves[name] = grow(tree, child, [token] * 6)   # 2 blocks each; 1 block left free
        tree.prune(child)
    c = tree.add_branch("c")
    assert reuse(tree, c, [1, 2, 3, 4] + [10] * 6)[0] == 10   # uses "old" again: now "mid" is the least recent
    assert leaves["old"] not in tree.cache and tree.num_available == 1 + 4
    freed = tree.evict(3)
    assert leaves["mid"].parent is None and leaves["new"] in tree.cache and len(freed) == 2
    taken = tree.take_blocks(5, "a test")   # 3 free: "new" makes way
    assert not tree.cache.nodes and leaves["new"].parent is None and leaves["old"].parent is not None
    with pytest.raises(OutOfBlocks):
        tree.take_blocks(1, "a test")
    tree.allocator.decref(taken)
    tree.audit()


def test_a_cached_parent_goes_after_its_children():
    tree = make_tree(cache=True)
    a = tree.add_branch("a")
    parent = grow(tree, a, [1, 2, 3, 4])
    (b,) = tree.fork(a, ["b"])
    child = grow(tree, b, [5, 6, 7, 8])
    tree.prune(b)
    tree.prune(a)
    assert {parent, child} == tree.cache.nodes and child.last_use > parent.last_use
    assert list(tree.cache.least_recently_used())[:1] == [child]
    tree.evict(tree.allocator.num_blocks)
    assert not tree.cache.nodes and tree.allocator.num_free == tree.allocator.num_blocks
    tree.audit()


def test_eviction_and_caching_are_undone_by_the_journal():
    tree = make_tree(num_blocks=6, cache=True)
    a = tree.add_branch("a")
    grow(tree, a, list(range(1, 9)))
    (b,) = tree.fork(a, ["b"])
    grow(tree, b, list(range(20, 28)))
    tree.prune(b)
    before = state(tree)
    mark = tree.journal.mark()
    tree.prune(a)
    tree.take_blocks(5, "a test")   # evicts every cached node
    assert not tree.cache.nodes
    tree.journal.rollback(mark)
    assert state(tree) == before
    tree.audit()


def test_drop_cache_frees_every_cached_block_and_dump_leaves_cached_nodes_out():
    tree = make_tree(cache=True)
    a = tree.add_branch("a")
    grow(tree, a, list(range(1, 9)))
    (b,) = tree.fork(a, ["b"])
    grow(tree, b, [30, 31, 32])
    (c,) = tree.fork(a, ["c"])
    kept = grow(tree, c, [40])
    tree.prune(b)
    dump, nodes = tree.dump()
    assert len(dump.nodes) == 2 and nodes == [a.node, kept]
    cached = tree.cache.num_blocks
    assert cached and len(tree.drop_cache()) == cached and tree.cache.num_blocks == 0
    tree.audit()


def test_audit_refuses_an_unreached_node_left_out_of_the_cache():
    tree = make_tree(cache=True)
    a = tree.add_branch("a")
    grow(tree, a, [1, 2, 3])
    (b,) = tree.fork(a, ["b"])
    leaf = grow(tree, b, [4])
    tree.prune(b)
    tree.cache.nodes.discard(leaf)   # as a bug that forgot it would
    tree.cache.num_blocks -= len(leaf.blocks)
    with pytest.raises(AssertionError, match="unreachable"):
        tree.audit()
