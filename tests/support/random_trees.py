"""Random branch trees for the attention tests: varied node lengths, forks mid-block, several depths; and
branches just given new tokens under shared nodes, with the prefill layout forward.py builds for them."""
import random

from dendrite_nb import Engine
from dendrite_nb.attention import BatchLayout
from dendrite_nb.kv.cascade import build_segments


def random_tree(eng: Engine, rng: random.Random, leaves: int, depth: int, vocab: int = 200):
    """Grow a random tree of branches with varied node lengths (mid-block forks included); return leaves."""
    root = eng.new_branch("r", [rng.randrange(vocab) for _ in range(rng.randrange(64, 120))])
    frontier = [root]
    for level in range(depth):
        grown = []
        for parent in frontier:
            for kid in eng.fork(parent, rng.randrange(1, 4)):
                eng.append(kid, [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
                grown.append(kid)
        frontier = grown[: max(2, leaves // (depth - level))]
    return frontier[:leaves]


def prefill_layout(eng: Engine, branches, q_lens, min_shared: int) -> BatchLayout:
    """The layout forward.py builds for a prefill of `q_lens` tokens just appended to each of `branches`."""
    tree = eng.branch_tree
    nodes = [branch.node for branch in branches]
    tables = [tree.block_table(node) for node in nodes]
    return BatchLayout(q_lens=list(q_lens), kv_lens=[node.end for node in nodes], block_tables=tables,
                       segments=build_segments(tree, nodes, tables, min_shared))


def appended_tree(eng: Engine, rng: random.Random):
    """Branches just given new tokens of different lengths in one append_many: forks of the root prompt (depth
    1), of deeper nodes and of leaves (nested shared nodes, mid-block forks), and one branch sharing nothing."""
    leaves = random_tree(eng, rng, leaves=6, depth=3)
    shallow = eng.fork("r", 2)   # random_tree's root prompt: 64-120 tokens
    solo = eng.new_branch("solo", [rng.randrange(200) for _ in range(rng.randrange(5, 30))])
    deeper = eng.fork(leaves[0], 2)   # two new leaves under an old one: it is shared, and so is its path
    branches = leaves[1:] + shallow + [solo] + deeper   # solo in the middle: the root's readers skip a row
    lengths = [rng.randrange(1, 40) for _ in branches]
    eng.append_many((branch, [rng.randrange(200) for _ in range(n)]) for branch, n in zip(branches, lengths))
    return branches, lengths, branches.index(solo)
