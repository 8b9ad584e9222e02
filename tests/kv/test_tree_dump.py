"""BranchTree.dump / load: a tree as plain data and back (what a save file records of it), with no field of the
tree set from outside. Random trees come back exactly (tokens, block tables through the blocks the new allocator
gave, log-probabilities, node ids, preempted counts); a dump that would not make a consistent tree is refused with
nothing changed; a restore whose file the schema passes but load refuses is a SaveFileError."""
import random
from dataclasses import replace

import pytest
import torch

from dendrite_nb import Engine, SaveFileError
from dendrite_nb.engine.branch_state import Branch as EngineBranch
from dendrite_nb.kv import BlockAllocator, BranchTree, TreeDump
from dendrite_nb.testing import TINY_SHAPES

BLOCK = 4
NUM_BLOCKS = 96


def random_tree(seed: int) -> BranchTree:
    """A tree grown by 60 random operations: new branches, appends (mid-block forks copy a block), forks, prunes,
    preemptions and resumptions, log-probabilities kept on some tokens."""
    rng = random.Random(seed)
    tree = BranchTree(BlockAllocator(NUM_BLOCKS), BLOCK)
    count = 0
    for _ in range(60):
        live = list(tree.branches.values())
        op = rng.choice(["new", "append", "append", "append", "fork", "prune", "preempt", "logprob"] if live
                        else ["new"])
        branch = rng.choice(live) if live else None
        if op == "new":
            tree.add_branch(f"b{count}")
            count += 1
        elif op == "append":
            if branch.node.swapped_blocks:
                if branch.node.swapped_blocks > tree.allocator.num_free:
                    continue
                tree.resume(branch.node)
            tokens = [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
            if tree.blocks_needed(branch, len(tokens)) <= tree.allocator.num_free:
                tree.append(branch, tokens)
        elif op == "fork" and not branch.node.swapped_blocks:
            names = [f"b{count + i}" for i in range(rng.randint(1, 3))]
            count += len(names)
            tree.fork(branch, names)
        elif op == "prune" and len(live) > 2:
            tree.prune(branch)
        elif op == "preempt" and tree.preemptible(branch):
            tree.preempt(branch)
        elif op == "logprob" and branch.node.tokens:
            branch.node.keep_logprob(rng.randrange(len(branch.node.tokens)), -rng.random() * 5)
        tree.journal.commit()
    tree.audit()
    return tree


def loadable(dump: TreeDump, num_blocks: int = NUM_BLOCKS) -> tuple[BranchTree, TreeDump, dict[int, int]]:
    """An empty tree with the dump's blocks allocated, the dump with its blocks renamed to those (as a restore
    does), and the renaming."""
    fresh = BranchTree(BlockAllocator(num_blocks), BLOCK)
    used = sorted({block for saved in dump.nodes for block in saved.blocks})
    moved = dict(zip(used, fresh.allocator.allocate(len(used))))
    renamed = TreeDump([replace(saved, blocks=[moved[b] for b in saved.blocks], tokens=list(saved.tokens),
                                logprobs=dict(saved.logprobs)) for saved in dump.nodes],
                       dict(dump.branches), dump.next_node_id)
    return fresh, renamed, moved


def state(tree: BranchTree) -> tuple:
    nodes = [(n.id, n.start, tuple(n.tokens), tuple(n.blocks), n.swapped_blocks, tuple(sorted(n.branch_names)))
             for n in tree.nodes()]
    return nodes, tree.allocator.num_free, tuple(sorted(tree.branches)), len(tree.journal)


@pytest.mark.parametrize("seed", range(12))
def test_a_random_tree_comes_back_exactly(seed):
    tree = random_tree(seed)
    dump, live = tree.dump()
    assert live == [node for node in tree.nodes() if node is not tree.root]
    assert [saved.id for saved in dump.nodes] == [node.id for node in live]
    fresh, renamed, moved = loadable(dump)
    made = fresh.load(renamed)
    fresh.audit()
    assert made == [node for node in fresh.nodes() if node is not fresh.root]
    assert fresh.dump() == (renamed, made)   # its own dump is the one it was loaded from
    assert sorted(fresh.branches) == sorted(tree.branches)
    for name, branch in tree.branches.items():
        back = fresh.branches[name]
        assert back.tokens == branch.tokens
        assert fresh.block_table(back.node) == [moved[b] for b in tree.block_table(branch.node)]
        assert fresh.path_logprobs(back.node) == tree.path_logprobs(branch.node)
        assert (back.node.id, back.node.swapped_blocks) == (branch.node.id, branch.node.swapped_blocks)
        assert isinstance(back, type(branch))
    assert fresh.allocator.num_free == tree.allocator.num_free


def test_the_loaded_tree_goes_on_as_the_original_would():
    """Node ids continue from the dump's next_node_id, and appends, forks and prunes behave the same."""
    tree = random_tree(3)
    fresh, renamed, _ = loadable(tree.dump()[0])
    fresh.load(renamed)
    for each in (tree, fresh):
        name = next(n for n, b in sorted(each.branches.items()) if not b.node.swapped_blocks)
        each.append(each.branches[name], [1, 2, 3, 4, 5])
        (child,) = each.fork(each.branches[name], ["after"])
        each.append(child, [6])
        each.journal.commit()
        each.audit()
    assert fresh.branches["after"].node.id == tree.branches["after"].node.id
    assert fresh.branches["after"].tokens == tree.branches["after"].tokens
    for each in (tree, fresh):
        for branch in list(each.branches.values()):
            each.prune(branch)
        each.audit()
        assert each.allocator.num_free == NUM_BLOCKS


def test_a_rollback_undoes_a_load():
    tree = random_tree(5)
    dump = tree.dump()[0]
    fresh = BranchTree(BlockAllocator(NUM_BLOCKS), BLOCK)
    empty = state(fresh)
    mark = fresh.journal.mark()
    _, renamed, _ = loadable(dump)   # the same allocator order: a fresh allocator hands out 0, 1, 2, ...
    fresh.allocator.allocate(len({b for saved in dump.nodes for b in saved.blocks}))
    fresh.load(renamed)
    fresh.journal.rollback(mark)
    assert state(fresh) == empty
    fresh.audit()


def small_dump() -> TreeDump:
    """Node 0: [1..6] (blocks 0, 1), read by g; node 1: t's [7, 8, 9] from position 6 (a mid-block child: blocks
    2, 3), a log-probability on its 8; node 2: f's [10] (block 4)."""
    tree = BranchTree(BlockAllocator(16), BLOCK)
    t = tree.add_branch("t")
    tree.append(t, [1, 2, 3, 4, 5, 6])
    (f,) = tree.fork(t, ["f"])
    tree.fork(t, ["g"])
    tree.append(t, [7, 8, 9])
    tree.append(f, [10])
    t.node.keep_logprob(1, -0.5)
    return tree.dump()[0]


@pytest.mark.parametrize("edit, message", [
    (lambda d: setattr(d.nodes[1], "parent", 2), "list each node after its parent"),
    (lambda d: setattr(d.nodes[0], "parent", 0), "list each node after its parent"),
    (lambda d: setattr(d.nodes[1], "id", d.nodes[0].id), "that no other node has"),
    (lambda d: setattr(d.nodes[2], "id", 0), "an int >= 1"),
    (lambda d: setattr(d.nodes[1], "start", 5), "it must start where its parent ends, 6"),
    (lambda d: d.nodes[0].blocks.pop(), "take 2 blocks of 4, but it holds 1"),
    (lambda d: d.nodes[1].tokens.extend([1, 2, 3, 4]), "take 3 blocks of 4, but it holds 2"),
    (lambda d: setattr(d.nodes[2], "preempted", 1), "preempted must be 0 or, for a node holding no blocks"),
    (lambda d: (setattr(d.nodes[0], "preempted", 2), d.nodes[0].blocks.clear()), "which only a node without"),
    (lambda d: d.branches.pop("f"), "nothing would reach it"),
    (lambda d: d.nodes[1].logprobs.update({3: -1.0}), "log-probabilities past its 3 tokens"),
    (lambda d: setattr(d, "next_node_id", 3), "next_node_id must be an int past every node's id"),
    (lambda d: d.nodes[2].blocks.__setitem__(0, d.nodes[1].blocks[0]), "block 2 is held 2 times in the dump"),
    (lambda d: d.nodes[2].blocks.__setitem__(0, 15), "block 15 is held 1 times in the dump but has refcount 0"),
    (lambda d: d.nodes[2].blocks.__setitem__(0, 16), "block 16 is no block of the pool"),
    (lambda d: d.branches.update({"": 0}), "a branch name must be a non-empty string"),
    (lambda d: d.branches.update({"g": 3}), "branch 'g' names node 3"),
])
def test_a_damaged_dump_is_refused_and_changes_nothing(edit, message):
    fresh, renamed, _ = loadable(small_dump(), num_blocks=16)
    edit(renamed)
    before = state(fresh)
    with pytest.raises(ValueError, match=message):
        fresh.load(renamed)
    assert state(fresh) == before


def test_a_dump_holding_fewer_blocks_than_are_in_use_is_refused():
    fresh, renamed, _ = loadable(small_dump(), num_blocks=16)
    fresh.allocator.allocate(1)   # held by nothing the dump lists
    before = state(fresh)
    with pytest.raises(ValueError, match="6 blocks are in use but the dump holds 5"):
        fresh.load(renamed)
    assert state(fresh) == before


def test_load_takes_only_an_empty_tree_and_state_for_its_own_branches():
    fresh, renamed, _ = loadable(small_dump(), num_blocks=16)
    before = state(fresh)
    with pytest.raises(ValueError, match="branch_state names 'zz', which is no branch of the dump"):
        fresh.load(renamed, {"zz": {}})
    assert state(fresh) == before
    fresh.load(renamed)
    before = state(fresh)
    with pytest.raises(ValueError, match="load needs an empty tree, but this one holds 3 branches"):
        fresh.load(renamed)
    assert state(fresh) == before


def test_each_branch_is_made_by_the_tree_s_branch_type_with_its_state():
    dump = small_dump()
    fresh = BranchTree(BlockAllocator(16), BLOCK, branch_type=EngineBranch)
    fresh.allocator.allocate(5)   # a fresh allocator's first blocks: the ones small_dump's tree took
    fresh.load(dump, {"t": {"seed": 11}, "f": {"seed": 12}})
    assert {name: (type(b), b.seed) for name, b in fresh.branches.items()} == {
        "t": (EngineBranch, 11), "f": (EngineBranch, 12), "g": (EngineBranch, 0)}   # g: the constructor's default
    fresh.audit()


def test_a_branch_state_its_type_refuses_changes_nothing():
    dump = small_dump()
    fresh = BranchTree(BlockAllocator(16), BLOCK, branch_type=EngineBranch)
    fresh.allocator.allocate(5)
    before = state(fresh)
    with pytest.raises(TypeError, match="colour"):
        fresh.load(dump, {"g": {"colour": "red"}})
    assert state(fresh) == before


def test_a_restore_that_load_refuses_is_a_save_file_error(tmp_path, monkeypatch):
    """The schema refuses every damaged manifest first (tests/engine/test_save_files_hostile.py); were one to slip
    through, load's refusal still reaches the user as a SaveFileError."""
    from dendrite_nb import persist

    config = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256)
    eng = Engine.from_random(config, weight_seed=1, num_blocks=16, block_size=BLOCK)
    eng.fork(eng.new_branch("t", list(range(7))), 2)
    path = eng.save(tmp_path / "session")
    assert torch.equal(Engine.restore(path).next_logits(["t/0"]), eng.next_logits(["t/0"]))
    checked = persist.check_manifest

    def passes_a_gap(manifest, tensors):
        checked(manifest, tensors)
        manifest["next_node_id"] = 1   # past the schema's check: load refuses it

    monkeypatch.setattr(persist, "check_manifest", passes_a_gap)
    with pytest.raises(SaveFileError, match="does not make a consistent session .*next_node_id must be"):
        Engine.restore(path)
