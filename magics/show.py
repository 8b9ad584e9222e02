"""%show: a branch's text from the root, split at the nodes where the tree forks, read from `engine.tree()`."""
from __future__ import annotations

from typing import Any

from dendrite_nb import Engine

from .results import Segment, Shown


def _branches_under(nodes: dict[int, dict[str, Any]], node_id: int) -> list[str]:
    names, stack = [], [node_id]
    while stack:
        current = nodes[stack.pop()]
        names.extend(current["branches"])   # sorted in the snapshot
        stack.extend(current["children"])
    return names


def show_branch(engine: Engine, name: str) -> Shown:
    snapshot = engine.tree()
    nodes = {node["id"]: node for node in snapshot["nodes"]}
    path: list[dict[str, Any]] = []
    node_id = snapshot["branches"][name]["node"]
    while node_id is not None:
        node = nodes[node_id]
        if node["num_tokens"]:
            path.append(node)
        node_id = node["parent"]
    path.reverse()
    tokens = [token for node in path for token in node["tokens"]]
    # Decode prefixes, not pieces: a character split over two nodes' tokens must not turn into two
    # replacement characters. End-of-turn tokens are left out, as in engine.text.
    prefix_texts = ([engine.decode(tokens[:node["start"]], skip_end_tokens=True) for node in path]
                    + [engine.decode(tokens, skip_end_tokens=True)])
    segments = []
    for index, node in enumerate(path):
        next_id = path[index + 1]["id"] if index + 1 < len(path) else None
        others = [other for other in node["branches"] if other != name]
        for child in node["children"]:
            if child != next_id:
                others.extend(_branches_under(nodes, child))
        text = prefix_texts[index + 1][len(prefix_texts[index]):]
        segments.append(Segment(node["id"], node["start"], text, tuple(others) if next_id is not None else ()))
    return Shown(name, tuple(segments))
