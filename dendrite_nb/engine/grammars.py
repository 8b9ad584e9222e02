"""Constrained decoding as branches see it: putting branches under a grammar, the per-step token masks, and
moving each branch's grammar position on as it grows. llguidance (guidance.py) loads on the first constraint.

Each branch's matcher is its own (forks copy it); every change to one is logged in the call's journal first.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import threading

import torch

from ..constraints import Constraint, parse_constraint
from ..errors import ConstraintError
from ..kv.journal import Journal, restore_attrs
from .branch_state import Branch
from .inputs import Inputs

Masks = tuple[list[int], Future]   # (the step's constrained rows, the bitmask being filled for them)


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, inputs: Inputs, journal: Journal):
        # inputs: whose eos_token_ids end a grammar's text, read when llguidance loads
        self.tokenizer, self.vocab_size, self.inputs, self.journal = tokenizer, vocab_size, inputs, journal
        self.guidance = None   # llguidance state, built by the first constraint
        self._making = threading.Lock()

    def parse(self, spec: dict[str, Any] | Constraint | None) -> Constraint | None:
        """parse_constraint(spec), its llguidance check made by starting the grammar under this engine's
        tokenizer: the grammar compiles once, and the start that follows (check_generate, attach) copies that
        matcher. A Constraint or None passes through unchanged."""
        if spec is None or isinstance(spec, Constraint):
            return spec
        return parse_constraint(spec, start=self.start)

    def start(self, constraint: Constraint):
        """A matcher at the start of the constraint's grammar; raises ConstraintError if the grammar cannot
        start, which changes nothing."""
        if self.guidance is None:
            from ..guidance import Guidance

            with self._making:   # Engine.parse_constraint may start one from another thread
                if self.guidance is None:
                    self.guidance = Guidance(self.tokenizer, self.vocab_size, self.inputs.eos_token_ids)
        return self.guidance.matcher(constraint)

    def attach(self, branches: list[Branch], constraint: Constraint) -> None:
        """Put each branch at the start of the constraint's grammar: one compile, then copies."""
        first = self.start(constraint)   # raises before any branch changes
        for index, branch in enumerate(branches):
            self.journal.log(restore_attrs, branch, {"constraint": branch.constraint, "matcher": branch.matcher,
                                                     "constraint_from": branch.constraint_from})
            branch.constraint, branch.matcher = constraint, first if index == 0 else first.deep_copy()
            branch.constraint_from = len(branch)

    def detach(self, branch: Branch) -> None:
        self.journal.log(restore_attrs, branch, {"constraint": branch.constraint, "matcher": branch.matcher})
        branch.constraint = branch.matcher = None

    def check_allows(self, branch: Branch, tokens: list[int]) -> None:
        """Raise ConstraintError unless the branch's grammar (if any) allows `tokens` next."""
        if branch.matcher is not None and branch.matcher.validate_tokens(tokens) != len(tokens):
            raise ConstraintError(f"branch {branch.name!r} decodes under a {branch.constraint.describe()} "
                                  f"constraint, which these tokens break; append text the grammar allows, "
                                  f"or remove the constraint with constrain({branch.name!r}, None).")

    def check_not_complete(self, branch: Branch) -> None:
        """Raise ConstraintError if the branch's grammar is complete: it may take no more tokens."""
        if branch.matcher is not None and branch.matcher.is_stopped():
            raise ConstraintError(f"branch {branch.name!r} has completed its {branch.constraint.describe()}; "
                                  f"fork it before it completes, or remove the constraint with "
                                  f"constrain({branch.name!r}, None) to keep writing.")

    def advance(self, branches: list[Branch], tokens: list[int]) -> None:
        """Move each constrained branch's grammar position past its token (one token or a run per branch)."""
        pairs = [(branch, token) for branch, token in zip(branches, tokens) if branch.matcher is not None]
        for branch, _ in pairs:   # the call's undo puts each grammar back where it was (a copy costs ~2 us)
            self.journal.log(restore_attrs, branch, {"matcher": branch.matcher.deep_copy()})
        if pairs:
            self.guidance.consume([b.matcher for b, _ in pairs], [t for _, t in pairs], [b.name for b, _ in pairs])

    def consume_run(self, branch: Branch, tokens: list[int]) -> None:
        """Move a constrained branch's grammar position past appended tokens (checked by check_allows)."""
        if branch.matcher is not None:
            self.journal.log(restore_attrs, branch, {"matcher": branch.matcher.deep_copy()})
            branch.matcher.consume_tokens(tokens)

    def start_masks(self, rows_branches: list[Branch]) -> Masks | None:
        """(rows, future bitmask) for the constrained branches among a step's rows, or None when there are none.
        The fill runs on a worker while the step's forward runs; it borrows the matchers until it ends."""
        rows = [row for row, branch in enumerate(rows_branches) if branch.matcher is not None]
        if not rows:
            return None
        return rows, self.guidance.start_fill([rows_branches[row].matcher for row in rows])

    def apply(self, logits: torch.Tensor, masks: Masks) -> None:
        """-inf in place on each constrained row's disallowed tokens (waits for the fill)."""
        self.guidance.apply(logits, masks[0], masks[1].result())

    def close(self) -> None:
        if self.guidance is not None:
            self.guidance.close()
            self.guidance = None
