"""Constraint specs: parse and validate a JSON schema, a regex, a Lark grammar or a list of choices.

A spec is a one-key mapping, the same in Python (`{"json_schema": {...}}`) and in a notebook cell's
metadata (`{"dendrite": {"json_schema": {...}}}`). Validation uses llguidance's own compiler, so a
spec that passes here is one llguidance can enforce; its error text is passed on unchanged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConstraintError

CONSTRAINT_KINDS = ("json_schema", "regex", "grammar", "choices")
LLGUIDANCE_FORMAT = {"json_schema": "json_schema", "regex": "regex", "grammar": "lark", "choices": "lark"}


@dataclass(frozen=True)
class Constraint:
    kind: str    # one of CONSTRAINT_KINDS
    value: Any   # dict (json_schema), str (regex, grammar) or tuple[str, ...] (choices)

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:   # a Constraint made by hand skips parse_constraint's checks
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(CONSTRAINT_KINDS)}.")

    def grammar_source(self) -> str:
        """The text llguidance compiles, in the format LLGUIDANCE_FORMAT[kind] names."""
        if self.kind == "json_schema":
            return json.dumps(self.value)
        if self.kind == "choices":  # JSON string escapes are valid Lark string literals
            return "start: " + " | ".join(json.dumps(choice) for choice in self.value)
        return self.value

    def describe(self) -> str:
        if self.kind == "json_schema":
            title = self.value.get("title") or self.value.get("type") or "schema"
            return f"json_schema ({title})"
        if self.kind == "choices":
            return f"choices ({len(self.value)} options)"
        first_line = self.value.strip().splitlines()[0] if self.value.strip() else ""
        return f"{self.kind} ({first_line[:40]})"


def parse_constraint(spec: Mapping[str, Any] | None) -> Constraint | None:
    """Validate a spec; None or {} means unconstrained. Raises ConstraintError saying what to fix."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise ConstraintError(f"a constraint is a mapping such as {{'json_schema': {{...}}}}, got {type(spec).__name__}.")
    unknown = [key for key in spec if key not in CONSTRAINT_KINDS]
    if unknown:
        raise ConstraintError(f"unknown constraint key {unknown[0]!r}; use one of {', '.join(CONSTRAINT_KINDS)}.")
    kinds = [key for key in CONSTRAINT_KINDS if key in spec]
    if len(kinds) > 1:
        raise ConstraintError(f"a generation takes one constraint, got {' and '.join(kinds)}; keep one of them.")
    if not kinds:
        return None
    kind = kinds[0]
    constraint = Constraint(kind, _CHECKERS[kind](spec[kind]))
    _check_with_llguidance(constraint)
    return constraint


# Nested dicts and lists a json_schema may hold. jsonschema's own check recurses about 8 Python frames per level
# of a schema, so about 200 levels exhaust Python's stack: a RecursionError traceback, not a message. Real
# schemas nest a few levels; 100 containers is 50 levels of "properties".
MAX_JSON_SCHEMA_DEPTH = 100


def _nests_too_deep(value: Any) -> bool:
    """Whether dicts and lists nest more than MAX_JSON_SCHEMA_DEPTH deep in `value` (a dict that holds itself
    does), walked without recursion and given up at the limit."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            if depth > MAX_JSON_SCHEMA_DEPTH:
                return True
            pending.extend((child, depth + 1) for child in children)
    return False


def _too_deep() -> ConstraintError:
    return ConstraintError(f"json_schema nests more than {MAX_JSON_SCHEMA_DEPTH} levels of objects and arrays (or "
                           f"holds itself); flatten it, or give it as a grammar.")


def _check_json_schema(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"json_schema is not valid JSON: {error}.") from error
        except RecursionError:
            raise _too_deep() from None
    if not isinstance(value, dict):
        raise ConstraintError(f"json_schema must be a JSON object (a dict), got {type(value).__name__}.")
    if _nests_too_deep(value):
        raise _too_deep()
    try:
        json.dumps(value)   # what llguidance compiles, and what a save file stores
    except (TypeError, ValueError) as error:
        raise ConstraintError(f"json_schema must hold only JSON values (dicts, lists, strings, numbers, booleans, "
                              f"null): {error}.") from None
    import jsonschema

    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "the top level"
        raise ConstraintError(f"json_schema is not a valid JSON Schema at {where}: {error.message}.") from error
    return value


def _check_text(kind: str):
    def check(value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ConstraintError(f"{kind} must be a non-empty string, got {value!r}.")
        return value
    return check


def _check_choices(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConstraintError(f"choices must be a non-empty list of strings, got {value!r}.")
    bad = [c for c in value if not isinstance(c, str) or not c]
    if bad:
        raise ConstraintError(f"each choice must be a non-empty string, got {bad[0]!r}.")
    if len(set(value)) != len(value):
        dup = next(c for c in value if value.count(c) > 1)
        raise ConstraintError(f"choice {dup!r} is listed twice; list each choice once.")
    return tuple(value)


_CHECKERS = {"json_schema": _check_json_schema, "regex": _check_text("regex"), "grammar": _check_text("grammar"),
             "choices": _check_choices}


def _check_with_llguidance(constraint: Constraint) -> None:
    import llguidance

    grammar = llguidance.grammar_from(LLGUIDANCE_FORMAT[constraint.kind], constraint.grammar_source())
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(f"llguidance cannot compile this {constraint.kind}: {'; '.join(messages).strip()}")
