"""Counts in user-facing text: "1 block", "2 blocks", "1,024 tokens"."""
from __future__ import annotations

# Nouns whose plural is not noun + "s".
_IRREGULAR_PLURALS = {"branch": "branches", "copy-on-write copy": "copy-on-write copies"}


def counted(count: int, noun: str) -> str:
    """`count` with thousands separators and `noun` in the number that count needs."""
    word = noun if count == 1 else _IRREGULAR_PLURALS.get(noun, noun + "s")
    return f"{count:,} {word}"
