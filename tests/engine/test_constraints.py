"""Constraint specs are validated (by llguidance's own compiler) before anything is generated."""
import pytest

from dendrite_nb import ConstraintError, parse_constraint


@pytest.mark.parametrize("spec, kind", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}, "json_schema"),
    ({"json_schema": '{"type": "array", "items": {"enum": [1, 2]}}'}, "json_schema"),
    ({"regex": r"\d{3}-[a-z]+"}, "regex"),
    ({"grammar": 'start: "yes" | "no"'}, "grammar"),
    ({"choices": ["left", "right", 'say "hi"']}, "choices"),
])
def test_valid_specs_parse(spec, kind):
    assert parse_constraint(spec).kind == kind


def test_empty_spec_means_unconstrained():
    assert parse_constraint(None) is None and parse_constraint({}) is None


@pytest.mark.parametrize("spec, message", [
    ({"json_schema": {"type": "bogus"}}, "not a valid JSON Schema at type"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1, 2]}, "must be a JSON object"),
    ({"regex": "(unclosed"}, "llguidance cannot compile this regex"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": "start: undefined_rule"}, "unknown name"),
    ({"choices": []}, "non-empty list"),
    ({"choices": "yes"}, "non-empty list"),
    ({"choices": ["a", "a"]}, "listed twice"),
    ({"regex": "a", "choices": ["a"]}, "one constraint"),
    ({"jsonschema": {}}, "unknown constraint key 'jsonschema'"),
    (["regex"], "mapping"),
])
def test_malformed_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ConstraintError, match=message):
        parse_constraint(spec)
