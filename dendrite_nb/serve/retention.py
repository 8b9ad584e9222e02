"""Which finished responses the server keeps as live branches, and which it lets go of first.

Every response id names branches of the tree (one per choice). They stay, so that a later request can continue
from them (previous_response_id, x-dendrite-parent) with nothing re-prefilled, or a notebook can fork them. Their
number is bounded (max_responses), and when the pool runs short the least recently used ones go first. Letting
go is a prune: with the engine's prefix_cache on, the KV stays as cache until the pool needs the blocks.

Touched only on the engine thread (the scheduler's), so it needs no lock.
"""
from __future__ import annotations

import collections
from typing import Any


class Retention:
    def __init__(self, engine: Any, max_responses: int):
        self.engine = engine
        self.max_responses = max_responses
        self._kept: collections.OrderedDict[str, tuple[str, ...]] = collections.OrderedDict()  # id -> branch names

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._kept

    def keep(self, response_id: str, branch_names: tuple[str, ...]) -> None:
        """A response finished: keep its branches, as the most recently used; let go of the oldest past the bound."""
        self._kept[response_id] = branch_names
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.max_responses:
            self.release(next(iter(self._kept)))

    def branch_of(self, reference: str) -> str | None:
        """The branch a continuation starts from: a response id with one choice, or "<id>/<choice>"; None if the
        server keeps no such response. Marks it used now."""
        response_id = reference
        if reference not in self._kept and "/" in reference:
            response_id = reference.rsplit("/", 1)[0]
        names = self._kept.get(response_id)
        if names is None:
            return None
        self._kept.move_to_end(response_id)
        if reference == response_id:
            return names[0] if len(names) == 1 else None
        return reference if reference in names else None

    def release(self, response_id: str) -> int:
        """Let go of a response: prune its branches that still exist. Returns the blocks that freed."""
        names = self._kept.pop(response_id, ())
        live = [name for name in names if name in self.engine.branches]
        return self.engine.prune(live) if live else 0

    def make_room(self, blocks: int) -> int:
        """Let go of the least recently used responses until `blocks` blocks are free or evictable, or none is
        left (a request that continues one forked it first, so its KV stays with the fork). Returns the blocks
        freed."""
        freed = 0
        for response_id in list(self._kept):
            if freed >= blocks:
                break
            before = self.engine.num_free_blocks + self.engine.num_cached_blocks
            self.release(response_id)
            freed += self.engine.num_free_blocks + self.engine.num_cached_blocks - before
        return freed
