"""Input at the edges that the API mishandled (issue 39, "Smaller"): a branch name no save can hold, a prompt far
too long for the context, a bad engine seed, numpy counts, and closing one of two engines that share a model.
Each case refuses clearly and changes nothing, or is taken as its plain-Python twin is."""
import random
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
from transformers import AutoTokenizer

import dendrite_nb.engine.build as engine_module  # where the weights load
from dendrite_nb import ContextOverflow, DecodeStep, DendriteError, Engine, SamplingParams
from dendrite_nb.testing import TINY_SHAPES

from tests.support.engines import refused

GREEDY = SamplingParams(temperature=0.0)
TINY_CONFIG = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=300)


# ---- branch names: one rule on every path that makes one -----------------------------------------------------------
SURROGATE_NAMES = ["a\ud800b", "\udfff", "tail\udbff"]


@pytest.mark.parametrize("name", SURROGATE_NAMES)
def test_fork_refuses_a_name_no_save_can_hold_and_saving_still_works(engine, tmp_path, name):
    """fork(names=...) took a lone surrogate, and then every save of the session failed."""
    root = engine.new_branch("root", "Some text")
    refused(engine, lambda: engine.fork(root, names=["fine", name]), ValueError, "surrogate code point")
    assert "fine" not in engine.branches   # all or nothing: the good name was not made either
    engine.save(tmp_path / "session.dnb")


def test_a_surrogate_pair_split_across_two_names_is_refused(engine):
    """The one check runs over all the names joined: two halves of a pair in two names are still two bad names."""
    root = engine.new_branch("root", "Some text")
    refused(engine, lambda: engine.fork(root, names=["x\ud83d", "\ude00y"]), ValueError, r"'x\\ud83d'")


@pytest.mark.parametrize("seed", [None, 7], ids=["derived seed", "own seed"])
def test_new_branch_refuses_it_with_the_same_error(engine, seed):
    """new_branch refused it only by accident (a UnicodeEncodeError from hashing the name into a seed), and not at
    all when the branch got its own seed."""
    refused(engine, lambda: engine.new_branch("a\ud800b", "hi", seed=seed), ValueError,
            r"branch name 'a\\ud800b' holds '\\ud800', a surrogate code point")


def test_names_of_any_other_text_are_taken(engine, tmp_path):
    root = engine.new_branch("root", "Some text")
    kids = engine.fork(root, names=["ünïcödé", "🌳 tree", "名前"])
    assert [k.name for k in kids] == ["ünïcödé", "🌳 tree", "名前"]
    engine.save(tmp_path / "session.dnb")


# ---- a prompt too long for the context is refused before it is tokenized -------------------------------------------
@pytest.fixture(scope="module")
def smol(demo_engine):
    """The real SmolLM2-135M (8,192 positions, byte-level BPE), one engine for the module."""
    return demo_engine(num_blocks=48)


@pytest.fixture
def encode_calls(smol, monkeypatch):
    """The lengths of the texts the tokenizer is asked to encode, while the test runs."""
    calls, real_encode = [], smol.tokenizer.encode

    def spy(text, *args, **kwargs):
        calls.append(len(text))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(smol.tokenizer, "encode", spy)
    return calls


FIVE_MB = ("The quick brown fox jumps over the lazy dog. " * 120_000)[:5_000_000]


@pytest.mark.parametrize("call", ["new_branch", "append", "chat"])
def test_a_5mb_prompt_is_refused_in_well_under_a_second(smol, encode_calls, call):
    """It was tokenized for 28 s (4.5 s on this CPU, 7.7 s as a chat message) before the length check refused it."""
    if "root" not in smol.branches:
        smol.new_branch("root", "Hello")
    calls = {"new_branch": lambda: smol.new_branch("huge", FIVE_MB), "append": lambda: smol.append("root", FIVE_MB),
             "chat": lambda: smol.chat("root", "user", FIVE_MB)}
    started = time.perf_counter()
    refused(smol, calls[call], ContextOverflow, r"needs at least [\d,]+ tokens .*the model allows 8,192")
    assert time.perf_counter() - started < 1.0
    assert not any(length >= len(FIVE_MB) for length in encode_calls)


def test_text_longer_than_the_context_that_fits_in_tokens_is_tokenized_as_before(smol, encode_calls):
    """8,240 characters (more than the 8,192 positions, so the bound is consulted) in 129 tokens: taken, with
    exactly the tokenizer's ids."""
    text = "#" * 80 * 103
    expected = smol.tokenizer.encode(text, add_special_tokens=True)
    assert len(text) > smol.config.max_position_embeddings > len(expected)
    branch = smol.new_branch("fits", text)
    try:
        assert branch.tokens == expected
        assert max(encode_calls) == len(text)
    finally:
        smol.prune(branch)


def test_text_the_bound_lets_through_is_still_refused_by_its_exact_count(smol):
    """18,000 characters of ' a' are 9,000 tokens: past the bound's 223, so they are tokenized, counted and refused."""
    refused(smol, lambda: smol.new_branch("long", " a" * 9_000), ContextOverflow,
            r"needs 9,000 tokens \(0 \+ 9,000\), the model allows 8,192")


def _stress_texts(tokenizer, count, seed):
    """Texts made to pack many characters into few tokens: the vocabulary's longest tokens, special tokens,
    whitespace runs, and characters of one to four UTF-8 bytes."""
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=len)[-50:]
    pieces = ([tokenizer.convert_tokens_to_string([token]) for token in longest] + list(tokenizer.all_special_tokens)
              + [" " * 40, "\n" * 30, "\t\t", "é", "e\u0301", "名前", "🌳", "\u200b", "ﬁ"])
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen2", "mistral", "smollm2"])
def test_the_bound_never_exceeds_the_real_count(checkpoint, real_gguf, smol, family):
    from dendrite_nb.token_bound import token_bound

    shapes = {"llama": "llama-gqa-untied", "phi3": "phi3-gqa-untied", "qwen2": "qwen2-gqa-tied",
              "mistral": "mistral-gqa-untied"}
    tokenizer = smol.tokenizer if family == "smollm2" else AutoTokenizer.from_pretrained(checkpoint(shapes[family]))
    bound = token_bound(tokenizer)
    assert bound is not None and bound.longest_chars > 1
    for text in _stress_texts(tokenizer, 300, seed=len(family)):
        assert bound.fewest_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False)), text


def test_special_tokens_that_swallow_whitespace_make_the_bound_skip_it(checkpoint):
    """Phi-3's special tokens strip the whitespace beside them: one token can stand for any run of it."""
    from dendrite_nb.token_bound import token_bound

    backend = Tokenizer.from_str(AutoTokenizer.from_pretrained(checkpoint()).backend_tokenizer.to_str())
    backend.add_special_tokens([AddedToken("<|x|>", lstrip=True, rstrip=True)])
    bound = token_bound(SimpleNamespace(backend_tokenizer=backend))
    text = "<|x|>" + " " * 2_000 + "<|x|>"
    count = len(backend.encode(text, add_special_tokens=False).ids)
    assert bound.skips_whitespace and bound.fewest_tokens(text) <= count
    assert -(-len(text) // bound.longest_chars) > count   # counting the swallowed spaces would refuse it wrongly


@pytest.mark.parametrize("change", ["deleting normalizer", "whitespace-dropping pre-tokenizer", "regex replace"])
def test_no_bound_for_a_tokenizer_that_can_drop_characters(checkpoint, change):
    """Then the text is tokenized and counted, as before: a bound that could refuse text that fits is worse."""
    from tokenizers import Regex

    from dendrite_nb.token_bound import token_bound

    backend = Tokenizer.from_str(AutoTokenizer.from_pretrained(checkpoint()).backend_tokenizer.to_str())
    if change == "deleting normalizer":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "")])
    elif change == "regex replace":
        backend.normalizer = normalizers.Replace(Regex(" +"), " ")
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel()])
    assert token_bound(SimpleNamespace(backend_tokenizer=backend)) is None
    assert token_bound(SimpleNamespace()) is None   # not a tokenizers-backed tokenizer at all


# ---- the engine's seed ----------------------------------------------------------------------------------------------
BAD_SEEDS = ["abc", 1.5, -1, 2**64, True, None]


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_a_bad_engine_seed_is_refused_before_the_weights_load(checkpoint, monkeypatch, seed):
    """Engine(seed="abc") was taken (and hashed into every branch's seed as text); now it is refused as a branch's
    seed is, before any weight is read."""
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the seed was checked")

    monkeypatch.setattr(engine_module, "load_model", no_weights)
    monkeypatch.setattr(engine_module, "random_model", no_weights)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        Engine.from_pretrained(checkpoint(), seed=seed)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        Engine.from_random(TINY_CONFIG, seed=seed)


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_a_bad_engine_seed_is_refused_around_a_model_object(seed):
    model = Engine.from_random(TINY_CONFIG, num_blocks=8, block_size=4).model
    with pytest.raises(ValueError, match="seed must be an int"):
        Engine(model, None, num_blocks=8, block_size=4, seed=seed)


def test_the_largest_seed_is_taken():
    engine = Engine.from_random(TINY_CONFIG, num_blocks=8, block_size=4, seed=2**64 - 1)
    branch = engine.new_branch("a", [1, 2, 3])
    assert len(engine.generate([branch], 2, SamplingParams(temperature=1.0, ignore_eos=True))[0]) == 2


# ---- numpy counts ---------------------------------------------------------------------------------------------------
def test_numpy_counts_are_taken_as_their_ints(engine):
    """fork(n=np.int64(2)) was refused; now every count takes any integer, used as a plain int."""
    root = engine.new_branch("root", "Some text to start with")
    numpy_kids = engine.fork(root, np.int64(2))
    plain_kids = engine.fork(root, names=["p0", "p1"])
    assert [k.name for k in numpy_kids] == ["root/0", "root/1"]
    steps = []
    with engine.subscribe(steps.append):
        numpy_out = engine.generate(numpy_kids, np.int64(3), GREEDY, max_batch=np.int32(1))
    assert numpy_out == engine.generate(plain_kids, 3, GREEDY, max_batch=1)
    assert {type(e.max_steps) for e in steps if isinstance(e, DecodeStep)} == {int}


def test_numpy_pool_sizes_are_taken_as_their_ints(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint(), block_size=np.int64(4), num_blocks=np.uint16(32))
    assert type(engine.pool.block_size) is int and engine.pool.num_blocks == 32
    engine.new_branch("a", "Some text")
    engine.save(tmp_path / "session.dnb")   # the manifest is JSON: a numpy int would not serialize


@pytest.mark.parametrize("n", [np.bool_(True), np.float64(2.0), np.int64(0), np.int8(-1)], ids=repr)
def test_numpy_values_that_are_not_counts_are_refused(engine, n):
    root = engine.new_branch("root", "Some text")
    refused(engine, lambda: engine.fork(root, n), ValueError, r"fork needs n >= 1")


# ---- close() lets go of what this engine holds, and only that ------------------------------------------------------
@pytest.fixture
def twins():
    """Two engines around one model object, as a notebook gets when it builds a second engine over `eng.model`."""
    first = Engine.from_random(TINY_CONFIG, num_blocks=32, block_size=4)
    return first, Engine(first.model, None, num_blocks=32, block_size=4)


def test_closing_one_engine_leaves_another_on_the_same_model_working(twins):
    """close() moved the shared model to the "meta" device: the other engine lost its weights."""
    first, second = twins
    prompt = [5, 17, 42, 9, 100, 3]
    before = second.generate([second.new_branch("p", prompt)], 6, GREEDY)
    first.new_branch("q", prompt)
    first.close()
    assert second.generate([second.new_branch("p2", prompt)], 6, GREEDY) == before
    second.audit()


def test_a_closed_engine_lets_go_of_its_weights_while_a_variable_still_holds_it():
    engine = Engine.from_random(TINY_CONFIG, num_blocks=32, block_size=4)
    engine.generate([engine.new_branch("a", [1, 2, 3])], 2, GREEDY)
    model, weight = weakref.ref(engine.model), weakref.ref(next(engine.model.parameters()))
    kv = weakref.ref(engine.pool.kv)
    engine.close()
    assert model() is None and weight() is None and kv() is None
    assert engine.closed and "closed" in repr(engine)


def test_every_call_on_a_closed_engine_says_it_was_closed(twins, tmp_path):
    first, second = twins
    first.new_branch("p", [1, 2, 3])
    first.close()
    calls = {"new_branch": lambda: first.new_branch("x", [1, 2]), "append": lambda: first.append("p", [4]),
             "fork": lambda: first.fork("p", 2), "prune": lambda: first.prune("p"),
             "generate": lambda: first.generate(["p"], 2, GREEDY), "next_logits": lambda: first.next_logits(["p"]),
             "preempt": lambda: first.preempt("p"), "tree": first.tree, "block_table": first.block_table,
             "audit": first.audit, "branch": lambda: first.branch("p"), "save": lambda: first.save(tmp_path / "s"),
             "model": lambda: first.model.config, "subscribe": lambda: first.subscribe(print)}
    for name, call in calls.items():
        with pytest.raises(DendriteError, match="this engine was closed"):
            call()
    assert not (tmp_path / "s").exists()
    first.close()   # again (a re-run cell): nothing to do, nothing raised
    assert first.closed
    second.generate([second.new_branch("b", [1, 2, 3])], 2, GREEDY)
