"""Constraint specs: parse and validate a JSON schema, a regex, a Lark grammar or a list of choices.

A spec maps one kind to its value, the same in Python (`{"json_schema": {...}}`) and in a notebook cell's
metadata (`{"dendrite": {"json_schema": {...}}}`). Validation uses llguidance's own compiler, so a
spec that passes here is one llguidance can enforce; its error text is passed on unchanged.

A json_schema spec may also carry llguidance's JSON-schema compiler options beside it,
`{"json_schema": {...}, "lenient": True, "coerce_one_of": True}`: they let llguidance accept schemas it
would otherwise refuse, by enforcing less than the schema says (see JSON_SCHEMA_OPTIONS), so such output
is not guaranteed to validate against the schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import ConstraintError

CONSTRAINT_KINDS = ("json_schema", "regex", "grammar", "choices")
LLGUIDANCE_FORMAT = {"json_schema": "json_schema", "regex": "regex", "grammar": "lark", "choices": "lark"}
# llguidance's JSON-schema compiler options a json_schema spec may set (llguidance reads them from the schema's
# "x-guidance" object). Both trade enforcement for coverage: output under them may not validate.
JSON_SCHEMA_OPTIONS = {
    "lenient": "ignore the keywords and formats llguidance does not implement (uniqueItems, not, if/then, ...) "
               "instead of refusing the schema, and treat oneOf as anyOf",
    "coerce_one_of": "treat oneOf as anyOf instead of refusing it (a value may then match several branches)",
}
# JSON output without free whitespace: a schema is about the values, and a sampling model (a random one
# above all) would otherwise spend its tokens on spaces and newlines between them.
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    kind: str    # one of CONSTRAINT_KINDS
    value: Any   # dict (json_schema), str (regex, grammar) or tuple[str, ...] (choices)
    options: tuple[tuple[str, bool], ...] = ()   # json_schema only: (name, on) of JSON_SCHEMA_OPTIONS, sorted

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:   # a Constraint made by hand skips parse_constraint's checks
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(CONSTRAINT_KINDS)}.")
        object.__setattr__(self, "options", _checked_options(self.kind, self.options))

    def spec(self) -> dict[str, Any]:
        """The mapping parse_constraint reads back into this constraint (what a save file stores)."""
        return {self.kind: list(self.value) if self.kind == "choices" else self.value, **dict(self.options)}

    def grammar_source(self) -> str:
        """The text llguidance compiles, in the format LLGUIDANCE_FORMAT[kind] names."""
        if self.kind == "json_schema":
            return json.dumps(self.value)
        if self.kind == "choices":  # JSON string escapes are valid Lark string literals
            return "start: " + " | ".join(json.dumps(choice) for choice in self.value)
        return self.value

    def grammar_text(self) -> str:
        """The llguidance grammar for this constraint: what validation and every start compile, and the key
        their compiles are cached by. A JSON schema's "x-guidance" gets JSON_DEFAULTS (compact whitespace)
        unless the schema sets its own, then the options; an option the schema's own "x-guidance" sets
        otherwise is refused."""
        import llguidance

        source = self.grammar_source()
        if self.kind == "json_schema" and ("x-guidance" not in self.value or self.options):
            own = self.value.get("x-guidance", JSON_DEFAULTS)
            if not isinstance(own, dict):
                raise ConstraintError(f"json_schema's \"x-guidance\" must be an object of llguidance's JSON "
                                      f"options, got {type(own).__name__}.")
            clash = [name for name, on in self.options if name in own and own[name] != on]
            if clash:
                raise ConstraintError(f"the option {clash[0]}={dict(self.options)[clash[0]]} contradicts the "
                                      f"schema's own \"x-guidance\" ({clash[0]}: {own[clash[0]]!r}); set it "
                                      f"in one place.")
            source = json.dumps({**self.value, "x-guidance": {**own, **dict(self.options)}})
        return llguidance.grammar_from(LLGUIDANCE_FORMAT[self.kind], source)

    def describe(self) -> str:
        if self.kind == "json_schema":
            title = self.value.get("title") or self.value.get("type") or "schema"
            flags = "".join(f"; {name}" for name, on in self.options if on)
            return f"json_schema ({title}{flags})"
        if self.kind == "choices":
            return f"choices ({len(self.value)} options)"
        first_line = self.value.strip().splitlines()[0] if self.value.strip() else ""
        return f"{self.kind} ({first_line[:40]})"


def parse_constraint(spec: Mapping[str, Any] | None, *,
                     start: Callable[[Constraint], Any] | None = None) -> Constraint | None:
    """Validate a spec; None or {} means unconstrained. Raises ConstraintError saying what to fix.

    A json_schema spec may set JSON_SCHEMA_OPTIONS beside it ({"json_schema": {...}, "lenient": True}); output
    under them is not guaranteed to validate against the schema. The llguidance check is cached by grammar
    (grammar_cache.check); an engine passes its own grammar start as `start` instead (Grammars.parse), so
    that the one compile is the matcher its generation then starts from."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise ConstraintError(f"a constraint is a mapping such as {{'json_schema': {{...}}}}, got {type(spec).__name__}.")
    unknown = [key for key in spec if key not in CONSTRAINT_KINDS and key not in JSON_SCHEMA_OPTIONS]
    if unknown:
        raise ConstraintError(f"unknown constraint key {unknown[0]!r}; use one of {', '.join(CONSTRAINT_KINDS)}, "
                              f"and with json_schema its options {', '.join(JSON_SCHEMA_OPTIONS)}.")
    kinds = [key for key in CONSTRAINT_KINDS if key in spec]
    if len(kinds) > 1:
        raise ConstraintError(f"a generation takes one constraint, got {' and '.join(kinds)}; keep one of them.")
    options = tuple((key, spec[key]) for key in JSON_SCHEMA_OPTIONS if key in spec)
    if not kinds:
        if options:
            raise ConstraintError(f"{options[0][0]} is an option of a json_schema constraint; give the schema "
                                  f"too, as {{'json_schema': {{...}}, {options[0][0]!r}: True}}.")
        return None
    kind = kinds[0]
    _checked_options(kind, options)   # a misplaced option is refused before the value's own (costlier) checks
    constraint = Constraint(kind, _CHECKERS[kind](spec[kind]), options)
    if start is not None:
        start(constraint)
    else:
        from .grammar_cache import check

        check(constraint)
    return constraint


def _checked_options(kind: str, options: Any) -> tuple[tuple[str, bool], ...]:
    """Constraint.options checked, sorted so that equal options make equal constraints however they were
    given; a ConstraintError says which options exist."""
    pairs = isinstance(options, tuple) and all(isinstance(pair, tuple) and len(pair) == 2
                                               and isinstance(pair[0], str) for pair in options)
    if not pairs or len(dict(options)) != len(options):
        raise ConstraintError(f"Constraint options are a tuple of (name, bool) pairs, each name once, such as "
                              f"(('lenient', True),); got {options!r}.")
    if options and kind != "json_schema":
        raise ConstraintError(f"{options[0][0]} is an option of a json_schema constraint "
                              f"({', '.join(JSON_SCHEMA_OPTIONS)}); a {kind} constraint takes none, so remove it.")
    for name, on in options:
        if name not in JSON_SCHEMA_OPTIONS:
            raise ConstraintError(f"unknown json_schema option {name!r}; the options are "
                                  + "; ".join(f"{known} ({what})" for known, what in JSON_SCHEMA_OPTIONS.items()) + ".")
        if not isinstance(on, bool):
            raise ConstraintError(f"json_schema option {name} must be true or false, got {on!r}; the options "
                                  f"({', '.join(JSON_SCHEMA_OPTIONS)}) are booleans.")
    return tuple(sorted(options))


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

