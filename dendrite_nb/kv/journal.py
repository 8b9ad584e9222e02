"""The undo log of one engine call, so that a call which fails leaves everything exactly as it was.

Every change to the branch tree and the block allocator logs, before it is made, how to put back what it
changes; the engine rolls the log back when a call raises (any exception, landing anywhere: Ctrl-C, a CUDA
out-of-memory error, a listener's bug) and empties it when the call completes. Each entry restores old
values rather than inverting an operation, so it is right whether the change it guards was made, half
made or not made at all: an exception may land between the log and the change, or in the change's middle.

Plain Python, no torch: the pool logs through here too (kv/pool.py), with tensors as opaque values.
"""
from __future__ import annotations

from typing import Any, Callable


class Journal:
    """A stack of (undo, *args) entries. `mark()` names a point; `rollback(mark)` undoes everything logged
    since, newest first; `commit()` forgets the whole log (the call, or a generate step, is done)."""

    __slots__ = ("entries",)

    def __init__(self):
        self.entries: list[tuple[Any, ...]] = []

    def log(self, undo: Callable[..., Any], *args: Any) -> None:
        self.entries.append((undo, *args))

    def mark(self) -> int:
        return len(self.entries)

    def rollback(self, mark: int = 0) -> None:
        """Undo, newest first, every entry logged since `mark`. Undo actions log nothing themselves."""
        entries = self.entries
        while len(entries) > mark:
            undo, *args = entries.pop()
            undo(*args)

    def commit(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)


# ---- undo actions: each puts one thing back, and may run whether or not the change happened ------------
def restore_key(mapping: dict, key: Any, old: Any, had: bool) -> None:
    """`mapping[key]` is `old` again, or absent if it was."""
    if had:
        mapping[key] = old
    else:
        mapping.pop(key, None)


def drop_keys(mapping: dict, keys: list) -> None:
    """Undo of adding new keys."""
    for key in keys:
        mapping.pop(key, None)


def restore_member(members: set, item: Any, was_in: bool) -> None:
    if was_in:
        members.add(item)
    else:
        members.discard(item)


def drop_members(members: set, items: set) -> None:
    """Undo of adding items that were not members."""
    members -= items


def restore_attrs(obj: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        setattr(obj, name, value)
