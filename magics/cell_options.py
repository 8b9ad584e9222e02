"""Where a generating cell's constraint comes from: the cell's Jupyter metadata, or inline options.

JupyterLab and Notebook 7 send a cell's whole metadata with its execute_request; the kernel keeps
that request as the "parent" of the running code. Front ends that send none (VS Code, nbval without
our plugin, plain IPython) can write options as the first lines of the cell:

    #| json_schema: $schema          (a Python variable in the notebook)
    #| json_schema: {"type": "object"}
    #| regex: \\d{3}-\\d{4}
    #| choices: ["yes", "no"]

Inline options are stripped from the prompt text. A cell may take its constraint from one place only: the
design's order (metadata before inline options) would silently ignore the other, so a cell with both is refused
with a UsageError that says to keep one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from IPython.core.error import UsageError

from dendrite_nb import ConstraintError, parse_constraint
from dendrite_nb.constraints import CONSTRAINT_KINDS, Constraint

METADATA_KEY = "dendrite"
INLINE_OPTION = re.compile(r"^#\|\s*(?P<key>[A-Za-z_][\w-]*)\s*:\s*(?P<value>.*?)\s*$")


@dataclass(frozen=True)
class CellOptions:
    constraint: Constraint | None   # validated; None means unconstrained
    origin: str                     # "cell metadata", "inline options" or "none"


def split_inline_options(text: str) -> tuple[dict[str, str], str]:
    """Leading `#| key: value` lines of a cell, and the text after them (blank lines before them skipped)."""
    lines = text.split("\n")
    options: dict[str, str] = {}
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.strip() and not options:
            index += 1
            continue
        match = INLINE_OPTION.match(line)
        if not match:
            break
        key = match["key"].replace("-", "_")
        if key in options:
            raise UsageError(f"inline option {key!r} is given twice; keep one `#| {key}: ...` line.")
        options[key] = match["value"]
        index += 1
    return options, "\n".join(lines[index:]) if options else text


def parse_inline_value(key: str, raw: str, user_ns: Mapping[str, Any]) -> Any:
    if raw.startswith("$"):
        name = raw[1:]
        if not name.isidentifier():
            raise UsageError(f"`#| {key}: {raw}` should name a Python variable, like `$my_schema`.")
        if name not in user_ns:
            raise UsageError(f"`#| {key}: ${name}` names a variable that is not defined; run the cell that "
                             f"defines {name} first.")
        return user_ns[name]
    if key in ("json_schema", "choices"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as error:
            raise UsageError(f"`#| {key}:` takes JSON or a $variable; {raw!r} is not valid JSON ({error}).") from error
    return raw  # regex and grammar are taken verbatim


def metadata_spec(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not metadata or METADATA_KEY not in metadata:
        return None
    spec = metadata[METADATA_KEY]
    if not isinstance(spec, Mapping):
        raise UsageError(f"cell metadata {METADATA_KEY!r} must be an object such as "
                         f'{{"json_schema": {{...}}}}, got {type(spec).__name__}.')
    return dict(spec)


def read_cell_options(metadata: Mapping[str, Any] | None, inline: dict[str, str],
                      user_ns: Mapping[str, Any]) -> CellOptions:
    """Validate the constraint of a cell; a UsageError says what to fix. Nothing is changed."""
    from_metadata = metadata_spec(metadata)
    unknown = [key for key in inline if key not in CONSTRAINT_KINDS]
    if unknown:
        raise UsageError(f"unknown inline option `#| {unknown[0]}:`; the options are "
                         f"{', '.join(CONSTRAINT_KINDS)}.")
    if from_metadata and inline:
        raise UsageError("this cell has a constraint both in its metadata and in `#|` lines; keep one of them.")
    if inline:
        spec, origin = {key: parse_inline_value(key, raw, user_ns) for key, raw in inline.items()}, "inline options"
    elif from_metadata:
        spec, origin = from_metadata, "cell metadata"
    else:
        return CellOptions(None, "none")
    try:
        return CellOptions(parse_constraint(spec), origin)
    except ConstraintError as error:
        raise UsageError(f"the constraint in the {origin} is not valid: {error}") from error


def cell_metadata(shell) -> dict[str, Any] | None:
    """The running cell's Jupyter metadata, as the front end sent it (None without a kernel, or when it sent none)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return None
    parent = kernel.get_parent()
    return (parent or {}).get("metadata") or None


def cell_constraint(shell, inline: dict[str, str], generating: bool) -> Constraint | None:
    """The constraint the running cell's metadata or `#|` lines set (validated), or None."""
    options = read_cell_options(cell_metadata(shell), inline, shell.user_ns)
    if options.constraint is not None and not generating:
        raise UsageError(f"this cell's {options.origin} set a {options.constraint.kind} constraint, but the cell "
                         f"does not generate; add --gen N to %%branch, or remove the constraint.")
    return options.constraint
