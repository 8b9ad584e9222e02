"""Random branch trees for the attention tests: varied node lengths, forks mid-block, several depths."""
import random

from dendrite_nb import Engine


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
