"""Paths a user types (`~` expanded, a `~user` with no home directory refused by name), and the cache folder
the demo models live in ($DENDRITE_NB_CACHE, else ~/.cache/dendrite_nb)."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError


def user_path(path: str | Path) -> Path:
    """`path` with `~` expanded; ValueError naming it when `~user` has no home (pathlib raises RuntimeError)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a path (a str or a pathlib.Path), got {type(path).__name__}.")
    try:
        return Path(path).expanduser()
    except RuntimeError as error:
        raise ValueError(f"cannot expand the path {str(path)!r}: {str(error).rstrip('.')}; give a full path.") from None


def default_cache_dir() -> Path:
    """$DENDRITE_NB_CACHE, else ~/.cache/dendrite_nb (not made here)."""
    env = os.environ.get("DENDRITE_NB_CACHE")
    return user_path(env) if env else Path.home() / ".cache" / "dendrite_nb"


def unwritable_cache(cache: Path, error: OSError, doing: str, given_as: str | None = None) -> CheckpointError:
    """The error for a cache folder that cannot be made or written in: it names where the folder came from
    (`given_as`, an argument's name, else $DENDRITE_NB_CACHE or the default) and what to do."""
    if given_as is not None:
        named, fix = given_as, "pass a folder you can write"
    else:
        named = "$DENDRITE_NB_CACHE" if os.environ.get("DENDRITE_NB_CACHE") else "the default cache"
        fix = "set DENDRITE_NB_CACHE to a folder you can write"
    why = "it is a file, not a folder" if cache.is_file() else f"{error.strerror or error} ({error.filename})"
    return CheckpointError(f"cannot {doing} in {str(cache)!r} ({named}): {why}; {fix}.")
