"""The engine's branch: the KV tree's named pointer (kv.tree.Branch) plus the state decoding keeps per branch.

The tree decides which blocks hold which tokens and never reads any of this. A fork gives each child its own
copy of this state in O(1) per child: the seed is derived from the parent's only when first used, the
conversation is shared by reference (it is immutable), and only a constrained parent's grammar position is
copied (one matcher copy per child, ~2 us).
"""
from __future__ import annotations

from typing import Any

import torch

from ..kv import tree as kv_tree
from ..kv.journal import restore_attrs
from ..sampling import derive_seed


class Branch(kv_tree.Branch):
    """A named, movable pointer to a node, and its decode state. Handles go stale when the branch is pruned."""

    __slots__ = ("_seed", "_seed_base", "generator", "constraint", "matcher", "constraint_from", "priority", "chat",
                 "finish_reason")

    def __init__(self, name: str, node: kv_tree.Node, tree: kv_tree.BranchTree, seed: int | None = 0,
                 seed_base: int = 0):
        # Branch.forks sets these same fields without calling __init__: a new field goes in both.
        super().__init__(name, node, tree)
        # A forked branch's seed is derived from its parent's on first use: hashing 1,000 names would
        # cost more than the fork itself.
        self._seed, self._seed_base = seed, seed_base
        self.generator = None  # the sampling generator, created on first use
        self.constraint = None  # the Constraint this branch decodes under, or None
        self.matcher = None     # its llguidance matcher: the grammar position after the branch's tokens
        self.constraint_from = 0  # the branch length when the constraint was attached (what the matcher consumed since)
        self.priority = 0.0  # generate(max_batch=...) decodes higher priorities first; forks inherit it
        # The conversation Engine.chat built here (an immutable chat.ChatState), or None; a fork shares it.
        self.chat = None
        # Why the branch's last generation stopped (decode.FINISH_REASONS: "eos", "stop_string",
        # "grammar_complete", "max_tokens"), or None before any; what the server reports as finish_reason.
        self.finish_reason = None

    @classmethod
    def forks(cls, names: list[str], node: kv_tree.Node, tree: kv_tree.BranchTree, parent: Branch) -> list[Branch]:
        """`Branch(name, node, tree, None, parent.seed)` for each name, at the parent's priority, conversation and
        grammar position, without an __init__ call per branch."""
        children = super().forks(names, node, tree, parent)
        seed_base, priority, chat = parent.seed, parent.priority, parent.chat
        constraint, matcher, since = parent.constraint, parent.matcher, parent.constraint_from
        for child in children:
            child._seed = None
            child._seed_base = seed_base
            child.generator = None
            child.priority = priority
            child.chat = chat
            child.finish_reason = None
            # Each child continues the grammar from the same position, on its own.
            if matcher is None:
                child.constraint, child.matcher, child.constraint_from = None, None, 0
            else:
                child.constraint, child.matcher, child.constraint_from = constraint, matcher.deep_copy(), since
        return children

    @property
    def seed(self) -> int:
        """The base of this branch's sampling generator (stable across processes)."""
        if self._seed is None:
            self._seed = derive_seed(self._seed_base, self.name)
        return self._seed

    def sampler(self, journal: Any, call_seed: int | None, device: torch.device) -> torch.Generator:
        """This branch's generator, made on first use (or afresh from a call's own seed); the change is logged in
        `journal` so a failed call puts the old one back."""
        if self.generator is None or call_seed is not None:
            journal.log(restore_attrs, self, {"generator": self.generator})
            seed = self.seed if call_seed is None else derive_seed(call_seed, self.name)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        return self.generator
