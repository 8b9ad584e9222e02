"""Paths a user types: `~` expanded, and a `~user` with no home directory refused by name."""
from __future__ import annotations

import os
from pathlib import Path


def user_path(path: str | Path) -> Path:
    """`path` with `~` expanded; ValueError naming it when `~user` has no home (pathlib raises RuntimeError)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a path (a str or a pathlib.Path), got {type(path).__name__}.")
    try:
        return Path(path).expanduser()
    except RuntimeError as error:
        raise ValueError(f"cannot expand the path {str(path)!r}: {error}; give a full path.") from None
