"""%show: a branch's text from the root, split at the nodes where the tree forks."""
from __future__ import annotations

from dendrite_nb import Engine
from dendrite_nb.kv import Branch
from dendrite_nb.kv.tree import Node

from .results import Segment, Shown


def _branches_under(node: Node) -> list[str]:
    names, stack = [], [node]
    while stack:
        current = stack.pop()
        names.extend(sorted(current.branch_names))
        stack.extend(current.children)
    return names


def show_branch(engine: Engine, branch: Branch) -> Shown:
    path: list[Node] = []
    node = branch.node
    while node is not None:
        if node.tokens:
            path.append(node)
        node = node.parent
    path.reverse()
    tokens = branch.tokens
    # Decode prefixes, not pieces: a character split over two nodes' tokens must not turn into two
    # replacement characters. End-of-turn tokens are left out, as in engine.text.
    prefix_texts = ([engine.decode(tokens[:n.start], skip_end_tokens=True) for n in path]
                    + [engine.decode(tokens, skip_end_tokens=True)])
    segments = []
    for index, node in enumerate(path):
        next_node = path[index + 1] if index + 1 < len(path) else None
        others = sorted(node.branch_names - {branch.name})
        for child in node.children:
            if child is not next_node:
                others.extend(_branches_under(child))
        text = prefix_texts[index + 1][len(prefix_texts[index]):]
        segments.append(Segment(node.id, node.start, text, tuple(others) if next_node is not None else ()))
    return Shown(branch.name, tuple(segments))
