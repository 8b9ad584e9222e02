"""llguidance's JSON-schema options on a constraint (lenient, coerce_one_of): parsed and checked, decoded under,
kept by forks and save files; and each grammar compiled once, counted at llguidance's door."""
import dataclasses
import json

import jsonschema
import llguidance
import pytest
from safetensors import safe_open

from dendrite_nb import ConstraintError, Engine, SamplingParams, SaveFileError, parse_constraint
from dendrite_nb.constraints import Constraint

from tests.engine.test_save_files_hostile import rewrite, set_
from tests.support.engines import engine_state

SAMPLE = SamplingParams(temperature=1.0, seed=11)
# llguidance does not implement uniqueItems: refused by default, ignored (so not enforced) under lenient.
UNIQUE_ITEMS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4,
                "uniqueItems": True}
# Disjoint branches llguidance cannot prove disjoint: refused by default; as anyOf (coerce_one_of) the same set.
ONE_OF = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "integer", "minimum": 10, "maximum": 999}]}


@pytest.fixture(scope="module")
def eng(checkpoint):
    return Engine.from_pretrained(checkpoint(), num_blocks=2_048, block_size=16, debug=True)


def text_of(eng, tokens):
    return eng.tokenizer.decode(tokens, skip_special_tokens=True)


def test_options_are_part_of_the_constraint():
    constraint = parse_constraint({"json_schema": UNIQUE_ITEMS, "coerce_one_of": False, "lenient": True})
    assert constraint.options == (("coerce_one_of", False), ("lenient", True))
    assert constraint == Constraint("json_schema", UNIQUE_ITEMS, (("lenient", True), ("coerce_one_of", False)))
    assert constraint != Constraint("json_schema", UNIQUE_ITEMS, (("lenient", True),))
    assert parse_constraint(constraint.spec()) == constraint   # what a save file stores reads back the same
    assert constraint.describe() == "json_schema (array; lenient)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        constraint.options = ()
    assert hash(parse_constraint({"choices": ["a", "b"]})) == hash(Constraint("choices", ("a", "b")))


@pytest.mark.parametrize("spec, message", [
    ({"json_schema": UNIQUE_ITEMS, "lenient": "yes"}, r"option lenient must be true or false, got 'yes'"),
    ({"json_schema": UNIQUE_ITEMS, "lenient": 1}, r"option lenient must be true or false, got 1"),
    ({"json_schema": UNIQUE_ITEMS, "strict": True},
     r"unknown constraint key 'strict'; .* options lenient, coerce_one_of"),
    ({"regex": "a+", "lenient": True}, r"lenient is an option of a json_schema constraint .* a regex constraint "
                                       r"takes none"),
    ({"coerce_one_of": True}, r"coerce_one_of is an option of a json_schema constraint; give the schema too"),
    ({"json_schema": {**ONE_OF, "x-guidance": {"coerce_one_of": False}}, "coerce_one_of": True},
     r"contradicts the schema's own \"x-guidance\""),
], ids=["a string", "an int", "an unknown option", "on a regex", "without a schema", "against the schema's own"])
def test_a_bad_option_says_which_options_exist(spec, message):
    with pytest.raises(ConstraintError, match=message):
        parse_constraint(spec)


@pytest.mark.parametrize("options, message", [
    ((("fast", True),), r"unknown json_schema option 'fast'; the options are lenient \(.*\); coerce_one_of \("),
    ({"lenient": True}, r"a tuple of \(name, bool\) pairs"),
    ((("lenient", True), ("lenient", False)), r"each name once"),
])
def test_a_constraint_made_by_hand_checks_its_options(options, message):
    with pytest.raises(ConstraintError, match=message):
        Constraint("json_schema", UNIQUE_ITEMS, options)


@pytest.mark.parametrize("schema, option, refusal", [
    (UNIQUE_ITEMS, "lenient", r"Unimplemented keys: \[\"uniqueItems\"\]"),
    (ONE_OF, "coerce_one_of", r"Enable 'coerce_one_of'"),
    (ONE_OF, "lenient", r"Enable 'coerce_one_of'"),   # lenient implies coerce_one_of
])
def test_a_schema_llguidance_refuses_by_default_is_accepted_with_the_option(schema, option, refusal):
    with pytest.raises(ConstraintError, match=refusal):
        parse_constraint({"json_schema": schema})
    assert parse_constraint({"json_schema": schema, option: True}).options == ((option, True),)


def test_coerce_one_of_leaves_unimplemented_keywords_refused():
    with pytest.raises(ConstraintError, match="uniqueItems"):
        parse_constraint({"json_schema": UNIQUE_ITEMS, "coerce_one_of": True})


def test_coerce_one_of_outputs_validate_and_forks_keep_the_option(eng):
    spec = {"json_schema": ONE_OF, "coerce_one_of": True}
    kids = eng.fork(eng.new_branch("pick", "A number:"), 6)
    outputs = eng.generate(kids, 64, SAMPLE, constraint=spec)
    for kid, tokens in zip(kids, outputs):
        assert kid.constraint == parse_constraint(spec) and kid.matcher.is_stopped()
        jsonschema.validate(json.loads(text_of(eng, tokens)), ONE_OF)   # disjoint branches: anyOf is oneOf here
    grandchildren = eng.fork(kids[0], 2)
    assert all(child.constraint.options == (("coerce_one_of", True),) for child in grandchildren)
    eng.prune("pick", kids, grandchildren)
    eng.audit()


def test_lenient_output_parses_but_need_not_validate(eng):
    spec = {"json_schema": UNIQUE_ITEMS, "lenient": True}
    kids = eng.fork(eng.new_branch("list", "Some digits:"), 6)
    outputs = eng.generate(kids, 64, SAMPLE, constraint=spec)
    without_unique = {key: value for key, value in UNIQUE_ITEMS.items() if key != "uniqueItems"}
    for kid, tokens in zip(kids, outputs):
        assert kid.matcher.is_stopped()
        jsonschema.validate(json.loads(text_of(eng, tokens)), without_unique)
    # the documented caveat: the grammar takes a repeated item, which the schema forbids
    repeated = eng.new_branch("repeated", "Some digits:")
    eng.constrain(repeated, spec)
    eng.append(repeated, "[1,1]")
    assert repeated.matcher.is_accepting()
    with pytest.raises(jsonschema.ValidationError, match="non-unique"):
        jsonschema.validate([1, 1], UNIQUE_ITEMS)
    eng.prune("list", kids, repeated)
    eng.audit()


# ---- save files ------------------------------------------------------------------------------------------------
def manifest_of(path):
    with safe_open(str(path), framework="pt") as file:
        return json.loads(file.metadata()["dendrite"])


@pytest.fixture(scope="module")
def saved_with_options(checkpoint, tmp_path_factory):
    """A session with a branch halfway through a lenient schema and one under a schema with no option."""
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    eng.generate([eng.new_branch("lenient", "Digits:")], 2, SAMPLE, constraint={"json_schema": UNIQUE_ITEMS,
                                                                                 "lenient": True})
    eng.generate([eng.new_branch("plain", "Digit:")], 1, SAMPLE, constraint={"json_schema": {"type": "integer"}})
    return eng, eng.save(tmp_path_factory.mktemp("options") / "session.dendrite")


def test_options_survive_save_and_restore(saved_with_options):
    eng, path = saved_with_options
    saved = {branch["name"]: branch["constraint"] for branch in manifest_of(path)["branches"]}
    assert saved["lenient"] == {"json_schema": UNIQUE_ITEMS, "lenient": True}
    assert saved["plain"] == {"json_schema": {"type": "integer"}}   # the one-key form files held before options
    restored = Engine.restore(path)
    for name in ("lenient", "plain"):
        assert restored.branch(name).constraint == eng.branch(name).constraint
    assert restored.generate(["lenient"], 40, SAMPLE) == eng.generate(["lenient"], 40, SAMPLE)
    restored.audit()


@pytest.mark.parametrize("constraint, message", [
    ({"json_schema": UNIQUE_ITEMS, "lenient": "yes"}, r"branches\[0\]\.constraint is not a valid constraint "
                                                      r"\(json_schema option lenient must be true or false"),
    ({"json_schema": UNIQUE_ITEMS}, r"branches\[0\]\.constraint is not a valid constraint .*uniqueItems"),
    ({"lenient": True}, r"branches\[0\]\.constraint should be null or an object with one key of"),
], ids=["a string option", "the option taken away", "an option without a schema"])
def test_a_crafted_option_in_a_save_file_is_refused(saved_with_options, tmp_path, constraint, message):
    eng, path = saved_with_options
    before = engine_state(eng)
    crafted = rewrite(path, tmp_path / "crafted.dendrite", set_(["branches", 0, "constraint"], constraint))
    with pytest.raises(SaveFileError, match=message):
        Engine.restore(crafted)
    assert engine_state(eng) == before


# ---- compile once ----------------------------------------------------------------------------------------------
class CountingMatcher:
    """llguidance.LLMatcher, recording each compile: ("start", grammar) under a tokenizer, ("check", grammar)
    without one."""

    def __init__(self, real):
        self.real, self.compiles = real, []

    def __call__(self, tokenizer, grammar, **options):
        self.compiles.append(("start", grammar))
        return self.real(tokenizer, grammar, **options)

    def validate_grammar(self, grammar, *args, **options):
        self.compiles.append(("check", grammar))
        return self.real.validate_grammar(grammar, *args, **options)

    def validate_grammar_with_warnings(self, grammar, *args, **options):
        self.compiles.append(("check", grammar))
        return self.real.validate_grammar_with_warnings(grammar, *args, **options)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def compiles(monkeypatch):
    counting = CountingMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    return counting.compiles


def fresh_spec(title: str) -> dict:
    """A schema no other test compiles (compiles are cached per process, by grammar text)."""
    return {"json_schema": {"title": title, "type": "object", "properties": {"n": {"type": "integer"}},
                            "required": ["n"]}}


def test_grammars_parse_compiles_once_and_the_generation_starts_from_that_compile(eng, compiles):
    spec = fresh_spec("parsed by the engine")
    constraint = eng._grammars.parse(spec)
    kids = eng.fork(eng.new_branch("once", "JSON:"), 3)
    eng.generate(kids, 2, SAMPLE, constraint=constraint)
    assert compiles == [("start", constraint.grammar_text())]
    eng.prune("once", kids)


def test_generate_and_constrain_compile_a_new_schema_once(eng, compiles):
    spec = fresh_spec("given to generate")
    kids = eng.fork(eng.new_branch("given", "JSON:"), 2)
    eng.generate(kids, 2, SAMPLE, constraint=spec)
    eng.constrain(eng.new_branch("again", "JSON:"), spec)
    parse_constraint(spec)   # checked by the start: no compile of its own
    assert compiles == [("start", parse_constraint(spec).grammar_text())]
    eng.prune("given", kids, "again")


def test_a_grammar_seen_before_compiles_no_more(eng, compiles):
    first, second = fresh_spec("first of two"), fresh_spec("second of two")
    texts = {parse_constraint(spec).grammar_text() for spec in (first, second)}
    for round_number in (1, 2):
        before = len(compiles)
        for spec in (first, second, first):   # two grammars taking turns: neither pushes the other out
            kids = eng.fork(eng.new_branch("turns", "JSON:"), 2)
            eng.generate(kids, 2, SAMPLE, constraint=spec)
            eng.constrain(eng.new_branch("held", "JSON:"), spec)
            parse_constraint(spec)
            eng.prune("turns", kids, "held")
        if round_number == 1:   # each grammar started once (and checked once, by parse_constraint, at most)
            assert sorted(text for what, text in compiles[before:] if what == "start") == sorted(texts)
            assert len(set(compiles[before:])) == len(compiles[before:])
        else:
            assert compiles[before:] == []
