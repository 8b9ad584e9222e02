"""Checks of what callers hand the engine, made before anything changes: token ids and text, branch references,
counts, the context window and the pool's room. Each raises a typed error that says what to pass instead.

Nothing here changes the tree; the engine's public calls run these first, then act.
"""
from __future__ import annotations

import numbers
from functools import cached_property
from typing import Any, Iterable, Sequence

import torch

from ..config import is_count
from ..errors import ContextOverflow, EmptyBranch, OutOfBlocks
from ..kv import BranchTree
from ..model.config import ModelConfig
from ..token_bound import TokenBound, token_bound
from .branch_state import Branch

BranchRef = Branch | str
TokensLike = str | Sequence[int]

# The most children one fork makes: each is a small Python object (about 0.3 KB with its name), and a count
# past this is a slip (1e12 children would take the host's memory), not a search.
MAX_FORK = 1_000_000

# str(i) for the first indexes, kept across forks: formatting 1,000 ints is a third of a 1,000-child fork.
_INDEX_TEXT: list[str] = []
_INDEX_TEXT_KEPT = 1 << 14


def _index_text(count: int) -> list[str]:
    """[str(i) for i in range(count)]."""
    wanted = min(count, _INDEX_TEXT_KEPT)
    if len(_INDEX_TEXT) < wanted:
        _INDEX_TEXT.extend(map(str, range(len(_INDEX_TEXT), wanted)))
    if count <= len(_INDEX_TEXT):
        return _INDEX_TEXT[:count]
    return _INDEX_TEXT + list(map(str, range(len(_INDEX_TEXT), count)))


class Inputs:
    """The engine's input checks, over its tokenizer, model config and branch tree (read, never changed)."""

    def __init__(self, tokenizer: Any | None, config: ModelConfig, tree: BranchTree, eos_token_ids: frozenset[int]):
        self.tokenizer, self.config, self.tree, self.eos_token_ids = tokenizer, config, tree, eos_token_ids

    # ---- text and token ids -----------------------------------------------------------------------
    @cached_property
    def _token_bound(self) -> TokenBound | None:
        """The fewest tokens a text can encode to with this tokenizer (token_bound.py), worked out on first need."""
        return token_bound(self.tokenizer)

    def check_text_fits(self, text: str, name: str, have: int) -> None:
        """Raise ContextOverflow, before `text` is tokenized, if its length alone says that its tokens cannot fit
        branch `name`, which holds `have` tokens."""
        # The bound never exceeds the text's length, so text no longer than the room skips it.
        if len(text) > self.config.max_position_embeddings - have and self._token_bound is not None:
            self.check_context(name, have, self._token_bound.fewest_tokens(text), at_least=True)

    def tokens(self, content: TokensLike, at_start: bool, onto: tuple[str, int] | None = None) -> list[int]:
        """Token ids of text or checked ids. onto: (branch name, its length) when they are to go onto that branch;
        text that cannot fit then raises ContextOverflow from its length alone, before it is tokenized."""
        if isinstance(content, str):
            if self.tokenizer is None:
                raise TypeError("this engine has no tokenizer (built from random weights); pass token ids.")
            if onto is not None:
                self.check_text_fits(content, *onto)
            bos = self.tokenizer.bos_token
            # Chat templates already write BOS; adding another would put two at the start.
            add_special = at_start and not (bos and content.startswith(bos))
            return self.tokenizer.encode(content, add_special_tokens=add_special)
        if isinstance(content, torch.Tensor):
            if content.dim() > 1 and content.shape[0] != 1:   # a batch: one branch takes one sequence
                raise ValueError(f"a tensor of token ids must hold one sequence ([T] or [1, T]); got shape "
                                 f"{tuple(content.shape)}. Give each row to its own branch.")
            content = content.flatten().tolist()
        if isinstance(content, (bytes, bytearray)) or not isinstance(content, Iterable):
            raise TypeError(f"content must be text (a str) or a sequence of token ids, got "
                            f"{type(content).__name__}" + (" (decode bytes to a str first)."
                                                         if isinstance(content, (bytes, bytearray)) else "."))
        tokens = list(content)
        vocab = self.config.vocab_size
        # numpy's integers are ids too (made plain ints); a bool is not, though Python makes it an int
        foreign = [t for t in tokens if type(t) is not int]
        bad = [t for t in foreign if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        bad += [t for t in tokens if not bad and not 0 <= t < vocab][:1]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is not an int in [0, {vocab:,}) (the vocabulary).")
        return [int(t) for t in tokens] if foreign else tokens

    def detokenize(self, ids: list[int], skip_end_tokens: bool = False) -> str:
        """Text of ids the engine holds or drew (valid by construction): no per-id check on the step's path."""
        if self.tokenizer is None:
            raise TypeError("this engine has no tokenizer (built from random weights).")
        if skip_end_tokens:
            ids = [i for i in ids if i not in self.eos_token_ids]
        return self.tokenizer.decode(ids)

    # ---- branches ---------------------------------------------------------------------------------
    def resolve_list(self, branches: BranchRef | Sequence[BranchRef]) -> list[Branch]:
        if not isinstance(branches, (Branch, str, Iterable)):
            raise TypeError(f"expected a branch, a branch name, or a list of them; got {type(branches).__name__}.")
        items = [branches] if isinstance(branches, (Branch, str)) else list(branches)
        if not items:
            raise ValueError("no branches given.")
        resolved = [self.tree.resolve(b) for b in items]
        self.check_unique(resolved)
        return resolved

    @staticmethod
    def check_unique(branches: list[Branch]) -> None:
        names = [b.name for b in branches]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"branch {dup!r} is listed twice; list each branch once.")

    @staticmethod
    def check_not_empty(branch: Branch) -> None:
        """Raise EmptyBranch unless the hidden state after the branch's last token (what decoding reads) is known."""
        if branch.node.last_hidden is None:
            length = len(branch)
            if not length:
                raise EmptyBranch(f"branch {branch.name!r} has no tokens yet; append a prompt first.")
            raise EmptyBranch(f"branch {branch.name!r} was rewound into a run of tokens, so the state after its last "
                              f"token is not known until it grows; append to it first (to go on from exactly these "
                              f"{length:,} tokens: rewind it to {length - 1:,} and append its last token again).")

    def child_names(self, parent: str, count: int) -> list[str]:
        """`count` names for a fork's children: parent/0, parent/1, ..., the lowest indices not taken."""
        prefix, taken = parent + "/", self.tree.branches
        names = [prefix + index for index in _index_text(count)]
        if taken.keys().isdisjoint(names):  # the usual case, in one pass
            return names
        # Some are taken (a second fork of the same parent): the lowest free indices, in order, found a
        # batch of `count` candidates at a time (one name at a time doubled a 1,000-child fork's cost).
        names = [name for name in names if name not in taken]
        start = count
        while len(names) < count:
            batch = _index_text(start + count)[start:]
            names += [name for name in map(prefix.__add__, batch) if name not in taken]
            start += count
        return names[:count]

    def fork_names(self, parent: str, n: Any, names: Sequence[str] | None) -> list[str]:
        """The children's names of fork(parent, n, names=...), checked for shape (the tree checks each name)."""
        if names is None:
            if not is_count(n) or n > MAX_FORK:
                raise ValueError(f"fork needs n >= 1 (an int, at most {MAX_FORK:,}) or names=[...], got n={n!r}.")
            return self.child_names(parent, int(n))  # numpy's ints too
        if isinstance(names, str):
            raise TypeError(f"names must be a list of names, got the string {names!r}.")
        if n is not None and n != len(names):
            raise ValueError(f"fork got n={n} and {len(names)} names; give one or the other.")
        names = list(names)
        if not names:
            raise ValueError("fork needs at least one name.")
        return names

    # ---- room ---------------------------------------------------------------------------------------
    def check_context(self, name: str, have: int, adding: int, at_least: bool = False) -> None:
        """Raise ContextOverflow if a branch of `have` tokens cannot take `adding` more (at_least: a lower bound
        on them, for text not tokenized yet)."""
        limit = self.config.max_position_embeddings
        if have + adding > limit:
            room = f"add at most {limit - have:,}" if have < limit else "it is full; fork from an earlier point"
            why = (" (its sliding window: past it the model would forget the oldest tokens, which dendrite-nb "
                   "does not do)" if self.config.sliding_window else "")
            least = "at least " if at_least else ""
            raise ContextOverflow(f"branch {name!r} needs {least}{have + adding:,} tokens ({have:,} + "
                                  f"{least}{adding:,}), the model allows {limit:,}{why}: {room}.")

    def check_blocks(self, growth: list[tuple[Branch, int]], what: str) -> None:
        """Raise OutOfBlocks if the pool cannot hold each (branch, tokens) growth at once (cached nodes' blocks
        count as available: they are evicted when needed)."""
        needed = sum(self.tree.blocks_needed(b, n) for b, n in growth)
        available = self.tree.num_available
        if needed > available:
            raise OutOfBlocks(needed, available, what)
