"""Bad input of the wrong type or shape: each call gets a clear, typed error that names the argument and what it
takes, and changes nothing (tree, block table, free blocks). Found by an audit of the public API; before it, these
calls raised Python's or torch's own errors from deep inside, failed later, or were taken silently."""
import pytest
import torch

from dendrite_nb import Constraint, ConstraintError, Engine, SamplingParams, SaveFileError, UnknownBranch

from tests.support.engines import engine_state, refused


@pytest.fixture
def populated(engine):
    a = engine.new_branch("a", "Some text to start the tree with")
    kids = engine.fork(a, 2)
    engine.generate(kids, 3, SamplingParams(temperature=0.0))
    return engine, a, kids


# ---- Engine -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", ["abc", 1.5])
def test_new_branch_refuses_a_seed_its_generator_cannot_take(populated, seed):
    """Refused at new_branch, not at the first sampled step inside torch (after a constraint was attached)."""
    engine, _, _ = populated
    refused(engine, lambda: engine.new_branch("x", "hi", seed=seed), (TypeError, ValueError), "seed")


def test_bytes_are_not_read_as_token_ids(populated):
    """Bytes are neither text nor token ids (they were read as ids 97 and 98)."""
    engine, a, _ = populated
    refused(engine, lambda: engine.append(a, b"ab"), (TypeError, ValueError), "bytes")


@pytest.mark.parametrize("call", ["append int", "append None", "new_branch int"])
def test_content_that_is_neither_text_nor_token_ids_says_what_is_expected(populated, call):
    """Not Python's "'int' object is not iterable": the error says what content is."""
    engine, a, _ = populated
    calls = {"append int": lambda: engine.append(a, 5), "append None": lambda: engine.append(a, None),
             "new_branch int": lambda: engine.new_branch("x", 5)}
    refused(engine, calls[call], (TypeError, ValueError), r"(?i)token ids|text")


def test_a_tensor_of_several_rows_is_not_concatenated(populated):
    """A [2, T] tensor (two prompts) is not flattened into one prompt of 2*T tokens."""
    engine, _, _ = populated
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    refused(engine, lambda: engine.new_branch("x", prompts), (TypeError, ValueError), r"(?i)row|shape|dim")


@pytest.mark.parametrize("items", [[("a", "x", "y")], "a"], ids=["triple", "string"])
def test_append_many_items_that_are_not_pairs_say_so(populated, items):
    """Not Python's "too many values to unpack": the error says items are (branch, content) pairs."""
    engine, _, _ = populated
    refused(engine, lambda: engine.append_many(items), (TypeError, ValueError), r"(?i)pair|\(branch")


@pytest.mark.parametrize("call", ["fork n=True", "generate max_new_tokens=True", "generate max_batch=True"])
def test_a_bool_is_not_a_count(populated, call):
    """True is not taken as 1 (one child, one token, one branch per step), as set_priority already refused it."""
    engine, a, kids = populated
    greedy = SamplingParams(temperature=0.0)
    calls = {"fork n=True": (lambda: engine.fork(a, True), r"\bn\b"),
             "generate max_new_tokens=True": (lambda: engine.generate(kids, True, greedy), "max_new_tokens"),
             "generate max_batch=True": (lambda: engine.generate(kids, 2, greedy, max_batch=True), "max_batch")}
    call, message = calls[call]
    refused(engine, call, (TypeError, ValueError), message)


def test_a_fork_past_the_cap_is_refused_before_any_name_is_made(populated):
    """fork(a, 10**12) used to build 10**12 names until the host ran out of memory."""
    from dendrite_nb.engine import MAX_FORK

    engine, a, _ = populated
    refused(engine, lambda: engine.fork(a, 10**12), ValueError, f"at most {MAX_FORK:,}")
    refused(engine, lambda: engine.fork(a, MAX_FORK + 1), ValueError, "n >= 1")


def test_token_ids_are_ints_numpy_ints_included_and_bools_not(populated):
    """numpy's integers are token ids (they were refused as "not an int"); True and False are not (they were
    taken as ids 1 and 0)."""
    np = pytest.importorskip("numpy")
    engine, a, _ = populated
    refused(engine, lambda: engine.append(a, [True, False]), ValueError, "True")
    ids = [5, 7, 11]
    assert engine.encode(np.array(ids)) == ids and all(type(t) is int for t in engine.encode(np.array(ids)))


@pytest.mark.parametrize("tokens, error, message", [([10**9], ValueError, "not an int in"), ([-1], ValueError, "vocabulary"),
                                                     ("abc", TypeError, "text already"), ([1.5], ValueError, "1.5")])
def test_decode_refuses_what_is_not_token_ids(populated, tokens, error, message):
    """decode([10**9]) was '' and decode("abc") torch's "cannot be interpreted as an integer"."""
    engine, _, _ = populated
    refused(engine, lambda: engine.decode(tokens), error, message)
    assert engine.decode(torch.tensor([[5, 6]])) == engine.decode([5, 6])


def test_check_growth_takes_a_count_of_tokens(populated):
    """check_growth(b, -5) was accepted silently (a negative growth always fits)."""
    engine, a, _ = populated
    refused(engine, lambda: engine.check_growth(a, -5), ValueError, "num_tokens")


@pytest.mark.parametrize("call", ["restore", "save"])
def test_a_path_that_is_not_a_path_says_so(populated, call):
    """Engine.restore(None) and save(None) name what a path is, not pathlib's TypeError about os.fspath."""
    engine, _, _ = populated
    calls = {"restore": lambda: Engine.restore(None), "save": lambda: engine.save(None)}
    refused(engine, calls[call], TypeError, "a path")


def test_generate_with_sampling_that_is_not_sampling_params(populated):
    """A dict is not a SamplingParams (it failed with "'dict' object has no attribute 'stop'")."""
    engine, _, kids = populated
    refused(engine, lambda: engine.generate(kids, 2, {"temperature": 0.0}), TypeError, "SamplingParams")


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": "0.5"}, "temperature"), ({"top_p": None}, "top_p"), ({"min_p": "0.1"}, "min_p"),
    ({"min_p": True}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": "2"}, "repetition_penalty"),
    ({"stop": 5}, "stop"), ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_sampling_params_of_the_wrong_type_name_the_field(kwargs, field):
    """Each field's error names it (a str temperature failed on '>=', and ignore_eos="no" counted as true)."""
    with pytest.raises((TypeError, ValueError), match=field):
        SamplingParams(**kwargs)


def test_top_k_true_is_refused_before_generate_attaches_its_constraint(populated):
    """top_k=True is refused before generate attaches its constraint (torch failed in the first step, and both
    branches kept the constraint)."""
    engine, _, kids = populated
    refused(engine, lambda: engine.generate(kids, 2, SamplingParams(top_k=True), constraint={"regex": "a+"}),
            (TypeError, ValueError), "top_k")


@pytest.mark.parametrize("branches", [None, 3])
def test_branches_that_are_not_a_list_say_what_is_expected(populated, branches):
    """The error says what a branches argument is, not "'NoneType' object is not iterable"."""
    engine, _, _ = populated
    refused(engine, lambda: engine.next_logits(branches), (TypeError, ValueError), r"(?i)branch")


def test_a_hand_made_constraint_of_unknown_kind_is_a_constraint_error(populated):
    """A Constraint made by hand with an unknown kind is a ConstraintError, not a raw KeyError: 'bogus'."""
    engine, _, kids = populated
    refused(engine, lambda: engine.constrain(kids[0], Constraint("bogus", "x")), ConstraintError, "bogus")


@pytest.mark.parametrize("how", ["3,000 levels", "as a string", "holds itself"])
def test_a_json_schema_nested_past_the_limit_is_a_constraint_error(populated, how):
    """A schema nested 3,000 levels deep was a RecursionError traceback out of json or jsonschema; one that held
    itself would have walked forever. Both are ConstraintErrors, and 49 levels of properties still compile."""
    engine, _, kids = populated
    schema = {"type": "string"}
    for _ in range(3000 if how != "holds itself" else 0):
        schema = {"type": "object", "properties": {"a": schema}}
    if how == "holds itself":
        schema["items"] = schema
    levels = '{"type": "object", "properties": {"a": '
    spec = levels * 3000 + '{"type": "string"}' + "}}" * 3000 if how == "as a string" else schema
    refused(engine, lambda: engine.constrain(kids[0], {"json_schema": spec}), ConstraintError, "nests more than")
    refused(engine, lambda: engine.generate(kids, 2, constraint={"json_schema": spec}), ConstraintError, "nests")
    deep_enough = {"type": "string"}
    for _ in range(49):
        deep_enough = {"type": "object", "properties": {"a": deep_enough}}
    engine.constrain(kids[0], {"json_schema": deep_enough})
    assert engine.branch(kids[0]).constraint.kind == "json_schema"


def test_a_handle_from_another_engine_is_not_reported_as_pruned(populated, tmp_path):
    """A handle of the saved engine used on the restored one: not "branch 'a/0' was pruned" about a live branch."""
    engine, _, kids = populated
    restored = Engine.restore(engine.save(tmp_path / "s.dendrite"))
    before = engine_state(restored)
    try:
        restored.prune(kids[0])
    except UnknownBranch as error:
        assert "was pruned" not in str(error) and "engine" in str(error), str(error)
        assert engine_state(restored) == before
    else:
        assert "a/0" not in restored.branches


@pytest.mark.parametrize("where", ["an existing directory", "under a regular file"])
def test_save_to_a_path_that_cannot_be_a_file_is_a_save_file_error(populated, tmp_path, where):
    """A SaveFileError naming the user's path, not an OSError about a hidden temporary file; no file is left."""
    engine, _, _ = populated
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    path = tmp_path / "adir" if where == "an existing directory" else tmp_path / "afile" / "s.dendrite"
    refused(engine, lambda: engine.save(path), SaveFileError, "adir|afile")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert list((tmp_path / "adir").iterdir()) == []


@pytest.mark.parametrize("options, name", [({"num_blocks": -3}, "num_blocks"), ({"num_blocks": 2.5}, "num_blocks"),
                                           ({"block_size": 2.5}, "block_size")])
def test_pool_sizes_are_checked_before_torch_allocates(checkpoint, options, name):
    """Refused by name before the weights load, not by torch's zeros() when the pool is allocated."""
    with pytest.raises((ValueError, TypeError), match=name):
        Engine.from_pretrained(checkpoint(), **options)
