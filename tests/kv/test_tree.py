"""The allocator and the branch tree on their own: plain Python, no model, milliseconds."""
import pytest

from dendrite_nb.engine.branch_state import Branch as EngineBranch
from dendrite_nb.errors import BranchExists, BranchPruned, OutOfBlocks, UnknownBranch
from dendrite_nb.kv import BlockAllocator, Branch, BranchTree

BLOCK = 4


def make_tree(num_blocks=32):
    return BranchTree(BlockAllocator(num_blocks), BLOCK)


def state(tree):
    nodes = [(n.id, n.start, tuple(n.tokens), tuple(n.blocks), tuple(sorted(n.branch_names))) for n in tree.nodes()]
    return nodes, tree.allocator.num_free, tuple(sorted(tree.branches))


def test_allocator_refcounts_and_free_list():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(3)
    assert alloc.num_free == 1 and all(alloc.refcount(i) == 1 for i in ids)
    alloc.incref(ids[0])
    assert alloc.decref([ids[0]]) == [] and alloc.refcount(ids[0]) == 1
    assert alloc.decref(ids) == ids and alloc.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        alloc.decref([ids[0]])


def test_allocator_out_of_blocks_changes_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks, match="needs 2 free KV blocks, the pool has 1"):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_audit_catches_a_leak():
    tree = make_tree()
    tree.allocator.allocate(1)  # held by no node
    with pytest.raises(AssertionError, match="refcount 1, held 0"):
        tree.audit()


def test_sole_owner_extends_in_place_and_fork_is_pointer_only():
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3])
    node = a.node
    tree.append(a, [4, 5, 6])
    assert a.node is node and node.tokens == [1, 2, 3, 4, 5, 6] and len(node.blocks) == 2
    before = state(tree)
    kids = tree.fork(a, ["x", "y"])
    nodes, free, _ = state(tree)
    assert free == before[1]
    assert [k.node for k in kids] == [node, node]
    assert [n[:4] for n in nodes] == [n[:4] for n in before[0]]  # no node, token or block changed
    tree.audit()


def test_append_after_fork_creates_children_with_copy_on_write_of_partial_tail():
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3, 4, 5, 6])  # blocks: [full, half]
    parent = a.node
    x, y = tree.fork(a, ["x", "y"])
    rec_x = tree.append(x, [7])
    rec_y = tree.append(y, [8, 9, 10])
    assert rec_x.created and rec_y.created and parent.children == [x.node, y.node]
    tail = parent.blocks[1]
    assert rec_x.cow == (tail, x.node.blocks[0]) and rec_y.cow == (tail, y.node.blocks[0])
    assert tree.block_table(x.node) == [parent.blocks[0], x.node.blocks[0]]
    assert tree.block_table(y.node) == [parent.blocks[0], y.node.blocks[0], y.node.blocks[1]]
    assert tree.path_tokens(y.node) == [1, 2, 3, 4, 5, 6, 8, 9, 10]
    # a is not a sole owner any more (its node has children): its next append is a child too
    rec_a = tree.append(a, [11])
    assert rec_a.created and a.node.parent is parent
    tree.audit()


def test_aligned_fork_needs_no_copy():
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3, 4])
    (x,) = tree.fork(a, ["x"])
    record = tree.append(x, [5])
    assert record.cow is None and tree.block_table(x.node) == a.node.blocks + x.node.blocks


def test_prune_frees_exactly_what_nothing_reaches():
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3, 4, 5])
    x, y = tree.fork(a, ["x", "y"])
    tree.append(x, [6, 7, 8, 9])
    tree.append(y, [10])
    shared = list(a.node.blocks)
    freed = tree.prune(x)
    assert sorted(freed) == sorted(set(freed)) and not set(freed) & set(shared)
    tree.prune(a)
    assert all(tree.allocator.refcount(b) == 1 for b in shared)  # y still reads them
    tree.prune(y)
    assert tree.allocator.num_free == 32 and tree.root.children == []
    tree.audit()


def test_a_leaf_again_after_its_children_go_can_be_extended_in_place():
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3])
    (x,) = tree.fork(a, ["x"])
    tree.append(x, [4])
    tree.prune(x)
    node = a.node
    record = tree.append(a, [5])
    assert not record.created and a.node is node and tree.path_tokens(node) == [1, 2, 3, 5]
    tree.audit()


def test_undo_restores_everything():
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3, 4, 5])
    (x,) = tree.fork(a, ["x"])
    before = state(tree)
    mark = tree.journal.mark()
    tree.append(x, [6, 7, 8, 9, 10])
    tree.append(a, [11])
    tree.journal.rollback(mark)
    assert state(tree) == before
    mark = tree.journal.mark()
    tree.append(tree.add_branch("solo"), [1, 2])
    tree.prune(tree.branches["solo"])
    tree.journal.rollback(mark)
    assert state(tree) == before and "solo" not in tree.branches
    tree.audit()


def test_out_of_blocks_append_changes_nothing():
    tree = make_tree(num_blocks=3)
    a = tree.add_branch("a")
    tree.append(a, [1] * 10)  # 3 blocks
    before = state(tree)
    with pytest.raises(OutOfBlocks):
        tree.append(a, [2] * 3)
    assert state(tree) == before


def test_a_forked_child_is_the_branch_the_constructor_makes():
    """Fork builds children without __init__; every field must still be set as __init__ sets it (the tree's own
    fields, and the decode state of the engine's branch type)."""
    tree = BranchTree(BlockAllocator(32), BLOCK, branch_type=EngineBranch)
    a = tree.add_branch("a", seed=7)
    a.priority = 2.5
    (child,) = tree.fork(a, ["c"])
    built = EngineBranch("c", a.node, tree, None, a.seed)
    built.priority = 2.5
    fields = Branch.__slots__ + EngineBranch.__slots__
    assert {f: getattr(child, f) for f in fields} == {f: getattr(built, f) for f in fields}
    assert child.seed == built.seed != a.seed


@pytest.mark.parametrize("names, error, message", [
    (["x", ""], ValueError, "got ''"), (["x", None], ValueError, "got None"), ([b"x"], ValueError, "got b'x'"),
    (["x", ("y",)], ValueError, "got \\('y',\\)"), (["x", "a"], BranchExists, "'a' already exists"),
    (["x", "y", "x"], BranchExists, "'x' appears twice"),
])
def test_a_fork_with_a_bad_name_changes_nothing(names, error, message):
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3, 4, 5])
    tree.fork(a, ["b"])
    before = state(tree)
    with pytest.raises(error, match=message):
        tree.fork(a, names)
    assert state(tree) == before and set(tree.branches) == {"a", "b"}
    tree.audit()


def test_names_are_checked():
    tree = make_tree()
    a = tree.add_branch("a")
    with pytest.raises(BranchExists):
        tree.fork(a, ["a"])
    with pytest.raises(BranchExists, match="twice"):
        tree.fork(a, ["b", "b"])
    with pytest.raises(UnknownBranch, match="no branch named 'zz'"):
        tree.resolve("zz")
    tree.prune(a)
    with pytest.raises(BranchPruned):
        tree.resolve(a)
    assert "pruned" in repr(a)


def _mixed_batch(tree):
    """Branches whose next token takes every path of an append: in place with room in the last block, in place
    into a new block, a child of a shared node (copy-on-write of its tail), and a first token off the root."""
    room = tree.add_branch("room")
    tree.append(room, [1, 2, 3, 4, 5])  # 5 tokens: the second block has room
    full = tree.add_branch("full")
    tree.append(full, [1, 2, 3, 4])  # a full block: the next token needs another
    shared = tree.add_branch("shared")
    tree.append(shared, [7, 8, 9])
    kid, _ = tree.fork(shared, ["kid", "other"])
    empty = tree.add_branch("empty")
    return [room, full, kid, empty]


def test_append_one_each_equals_appends_one_by_one():
    trees = [make_tree(), make_tree()]
    batches = [_mixed_batch(tree) for tree in trees]
    mark = trees[0].journal.mark()
    batched = trees[0].append_one_each(batches[0], 42)
    single = [trees[1].append(branch, [42]) for branch in batches[1]]
    assert state(trees[0]) == state(trees[1])
    fields = ("created", "old_num_tokens", "old_num_blocks", "cow")
    assert [[getattr(r, f) for f in fields] for r in batched] == [[getattr(r, f) for f in fields] for r in single]
    assert [r.branch.name for r in batched] == [r.branch.name for r in single]
    trees[0].journal.rollback(mark)
    fresh = make_tree()
    _mixed_batch(fresh)
    assert state(trees[0]) == state(fresh)
    trees[0].audit()


def test_append_one_each_out_of_blocks_changes_nothing():
    tree = make_tree(num_blocks=6)
    batch = _mixed_batch(tree)  # 2 + 1 + 1 blocks held; the batch needs 1 (full) + 1 (kid's copy) + 1 (empty)
    tree.allocator.allocate(tree.allocator.num_free - 2)
    before = state(tree)
    with pytest.raises(OutOfBlocks):
        tree.append_one_each(batch, 42)  # room goes in place, full and kid take the last two, empty fails
    assert state(tree) == before


def test_a_leaf_block_table_follows_its_blocks():
    """Leaves keep their table between steps; it must still be the table after any change to their blocks."""
    tree = make_tree()
    a = tree.add_branch("a")
    tree.append(a, [1, 2, 3])
    (x,) = tree.fork(a, ["x"])
    tree.append(x, [4])  # x: a child with a copy of a's partial tail block

    def fresh(node):
        return tree._path(node, "table")
    assert tree.block_table(x.node) == fresh(x.node)
    seen = tree.block_table(x.node)
    for token in range(5, 12):  # into x's tail block, then new ones
        mark = tree.journal.mark()
        tree.append(x, [token])
        assert tree.block_table(x.node) == fresh(x.node)
    assert tree.block_table(x.node) is not seen and len(tree.block_table(x.node)) == 3
    tree.journal.rollback(mark)
    assert tree.block_table(x.node) == fresh(x.node)
    freed = tree.preempt(x)
    assert tree.block_table(x.node) == fresh(x.node) == tree.block_table(a.node)[:0]  # a's blocks before x's start
    tree.allocator.allocate(len(freed))  # the freed blocks are taken: resuming gets others
    tree.resume(x.node)
    assert tree.block_table(x.node) == fresh(x.node) and not set(freed) & set(x.node.blocks)
