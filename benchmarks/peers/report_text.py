"""How the llama.cpp comparisons print seconds and compare token lists: plain text, no llama.cpp, no torch (the GPU
comparison's engine process imports this without either peer's libraries)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sweep import Trial


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Index of the first token that differs (or where one list ends early); None when equal."""
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return index
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def tokens_text(trial: Trial, reference: Trial) -> str:
    if not reference.tokens:
        return "-"
    where = first_difference(reference.tokens, trial.tokens)
    return "same" if where is None else f"differ from {where} of {len(reference.tokens)}"
