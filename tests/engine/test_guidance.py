"""Constrained decoding with llguidance on the tiny random model, sampling at temperature 1.0: every
output parses and validates, forks continue the grammar independently, bad input changes nothing."""
import json
import re

import jsonschema
import pytest

from dendrite_nb import ConstraintError, Engine, SamplingParams

from tests.support.engines import engine_state, interrupt_forward_call
from tests.support.json_schemas import SCHEMAS

SAMPLE = SamplingParams(temperature=1.0, seed=7)
BUDGET = 1800   # tokens per branch; a random model's strings end when it happens to draw a quote


@pytest.fixture(scope="module")
def eng(checkpoint):
    return Engine.from_pretrained(checkpoint(), num_blocks=12_288, block_size=16, debug=True)


def text_of(eng, tokens):
    return eng.tokenizer.decode(tokens, skip_special_tokens=True)


def test_every_output_of_26_schemas_parses_and_validates(eng):
    """All schemas, three seeds each, in one batch: every row has its own grammar (a mixed batch).
    Formats (date, email) are checked too, not only the structure."""
    assert len(SCHEMAS) >= 25
    names = []
    for index, schema in enumerate(SCHEMAS):
        for seed in (1, 2, 3):
            name = f"schema{index}/seed{seed}"
            eng.new_branch(name, "Answer in JSON:", seed=seed)
            eng.constrain(name, {"json_schema": schema})
            names.append((name, schema))
    outputs = eng.generate([n for n, _ in names], BUDGET, SAMPLE)
    for (name, schema), tokens in zip(names, outputs):
        assert eng.branch(name).matcher.is_stopped(), f"{name} did not complete its grammar in {BUDGET} tokens"
        value = json.loads(text_of(eng, tokens))
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    eng.prune([n for n, _ in names])
    eng.audit()


@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[a-z]{2,5}@[0-9]{3}"}, lambda text: re.fullmatch(r"[a-z]{2,5}@[0-9]{3}", text)),
    ({"regex": r"(yes|no)\.?"}, lambda text: re.fullmatch(r"(yes|no)\.?", text)),
    ({"grammar": 'start: expr\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/'},
     lambda text: re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text)),
    ({"choices": ["left", "right", "straight on"]}, lambda text: text in ("left", "right", "straight on")),
])
def test_regex_lark_and_choices_outputs_always_match(eng, spec, check):
    kids = eng.fork(eng.new_branch("ask", "Which way?"), 6)
    outputs = eng.generate(kids, 200, SAMPLE, constraint=spec)
    for kid, tokens in zip(kids, outputs):
        text = text_of(eng, tokens)
        assert check(text), f"{kid.name}: {text!r} does not match {spec}"
    eng.prune("ask", kids)


def test_eight_forks_halfway_through_an_object_all_complete_valid_objects(eng):
    schema = SCHEMAS[15]   # {"address": {"city": ..., "zip": "12345"}}
    parent = eng.new_branch("half", "Where?")
    eng.constrain(parent, {"json_schema": schema})
    first = eng.generate([parent], 4, SAMPLE)[0]   # part of the object, not all of it
    assert not parent.matcher.is_stopped()
    kids = eng.fork(parent, 8)
    outputs = eng.generate(kids, BUDGET, SAMPLE)
    texts = {text_of(eng, first + tokens) for tokens in outputs}
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(texts) > 1   # the siblings went their own ways from the same grammar position
    eng.prune("half", kids)


def test_an_unconstrained_sibling_decodes_exactly_as_it_would_alone(eng):
    eng.new_branch("free", "Tell me")
    expected = eng.generate(eng.fork("free", names=["x"]), 12, SAMPLE)[0]
    eng.prune("x")
    mixed = eng.fork("free", names=["x", "json"])   # the same name, so the same sampler seed
    eng.constrain("json", {"json_schema": SCHEMAS[13]})
    got = eng.generate(mixed, 12, SAMPLE)[0]
    assert got == expected
    eng.prune("free", *mixed)


def test_bad_constraints_fail_before_decoding_and_change_nothing(eng):
    eng.new_branch("safe", "Hello")
    before = engine_state(eng)
    cases = [({"json_schema": {"type": "nonsense"}}, "not a valid JSON Schema"),
             ({"regex": "[a-z"}, "llguidance cannot compile this regex"),
             ({"grammar": "start: missing_rule"}, "llguidance cannot compile this grammar"),
             ({"choices": []}, "non-empty list"),
             ({"colour": "red"}, "unknown constraint key 'colour'"),
             # compile, but no text can start them: one line saying so, not llguidance's parser state and grammar
             ({"regex": r"[^\s\S]"}, "this regex matches no text"),
             ({"json_schema": {"$ref": "#"}}, "this json_schema matches no text")]
    for spec, message in cases:
        with pytest.raises(ConstraintError, match=message) as raised:
            eng.generate(["safe"], 5, SAMPLE, constraint=spec)
        if "matches no text" in message:
            assert "\n" not in str(raised.value) and len(str(raised.value)) < 400
        with pytest.raises(ConstraintError, match=message):
            eng.constrain("safe", spec)
        assert engine_state(eng) == before and eng.branch("safe").matcher is None
    eng.prune("safe")


def test_appends_must_fit_the_grammar_and_move_it_forward(eng):
    branch = eng.new_branch("tool", "Call:")
    eng.constrain(branch, {"choices": ["search(x)", "calc(y)"]})
    before = engine_state(eng)
    with pytest.raises(ConstraintError, match="which these tokens break"):
        eng.append(branch, "delete(z)")
    assert engine_state(eng) == before
    eng.append(branch, "calc(")
    out = eng.generate([branch], 20, SAMPLE)[0]
    assert text_of(eng, out).startswith("y)") and branch.matcher.is_stopped()
    with pytest.raises(ConstraintError, match="has completed its choices"):
        eng.generate([branch], 5, SAMPLE)
    eng.constrain(branch, None)   # lifting the constraint lets it write freely again
    assert len(eng.generate([branch], 3, SamplingParams(temperature=1.0, seed=1, ignore_eos=True))[0]) == 3
    eng.prune("tool")


def test_a_forward_interrupted_mid_step_rolls_the_grammar_back_with_the_tokens(eng, monkeypatch):
    """The matchers advance before the forward (so masks fill during it); an undone step undoes that too."""
    schema = SCHEMAS[13]
    branch = eng.new_branch("cut", "Who?")
    prompt_length = len(branch)
    interrupt_forward_call(monkeypatch, eng, 4)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([branch], BUDGET, SamplingParams(temperature=1.0, seed=7), constraint={"json_schema": schema})
    monkeypatch.undo()
    kept = branch.tokens[prompt_length:]
    assert len(kept) == 3   # three steps landed, the fourth was undone
    rest = eng.generate([branch], BUDGET, SamplingParams(temperature=1.0))[0]   # the grammar continues from there
    jsonschema.validate(json.loads(text_of(eng, kept + rest)), schema)   # fails if the matcher kept token 4
    eng.prune("cut")
    eng.audit()
