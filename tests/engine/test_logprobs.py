"""generate(..., logprobs=True): each sampled token keeps the model's own log-probability, equal to
transformers' log_softmax within 1e-4; forks share their parent's; saving keeps them; bad input changes nothing."""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams

from tests.support.engines import engine_state

TOLERANCE = 1e-4
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, ignore_eos=True)


def reference_logprobs(hf, tokens):
    """log_softmax of transformers' logits: row t scores token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1)


def assert_match(eng, hf, branch):
    kept, tokens = eng.logprobs(branch), branch.tokens
    assert len(kept) == len(tokens)
    reference = reference_logprobs(hf, tokens)
    scored = [(position, logprob) for position, logprob in enumerate(kept) if logprob is not None]
    for position, logprob in scored:
        assert abs(logprob - reference[position - 1, tokens[position]].item()) < TOLERANCE, position
    return scored


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_sampled_tokens_keep_the_models_log_probability(shape, checkpoint, hf_model):
    eng = Engine.from_pretrained(checkpoint(shape), num_blocks=64, block_size=4)
    root = eng.new_branch("root", "Three ways across the river:")
    kids = eng.fork(root, 3)
    outputs = eng.generate(kids, 10, SAMPLED, logprobs=True)  # raw logprobs: not the tempered, nucleus one
    for kid, output in zip(kids, outputs):
        scored = assert_match(eng, hf_model(shape), kid)
        assert [position for position, _ in scored] == list(range(len(root), len(kid)))  # prompt: none
        assert len(output) == len(scored) == 10


def test_a_constrained_token_keeps_the_unmasked_log_probability(checkpoint, hf_model):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64)
    branch = eng.new_branch("answer", "Answer:")
    eng.generate([branch], 8, SamplingParams(temperature=1.0), constraint={"regex": "(yes|no|maybe)"},
                 logprobs=True)
    assert assert_match(eng, hf_model("llama-gqa-untied"), branch)


def test_forks_share_their_parents_entries_and_later_tokens_without_logprobs_have_none(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    root = eng.new_branch("root", "A fork shares")
    eng.generate([root], 5, SAMPLED, logprobs=True)
    parent = eng.logprobs(root)
    kid = eng.fork(root, names=["kid"])[0]
    eng.generate([kid], 3, SAMPLED)
    eng.append(kid, " more")
    kept = eng.logprobs(kid)
    assert kept[: len(parent)] == parent and all(lp is None for lp in kept[len(parent):])
    assert sum(lp is not None for lp in parent) == 5 and all(lp <= 0 for lp in parent if lp is not None)
    eng.audit()


def test_a_saved_session_keeps_its_logprobs(checkpoint, tmp_path):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    branch = eng.new_branch("root", "Saved with")
    eng.generate([branch], 6, SAMPLED, logprobs=True)
    eng.save(tmp_path / "s.dendrite")
    restored = Engine.restore(tmp_path / "s.dendrite")
    assert restored.logprobs("root") == eng.logprobs("root")


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_logprobs_that_are_not_a_bool_are_refused_and_change_nothing(engine, bad):
    branch = engine.new_branch("b", "Hello")
    before = engine_state(engine)
    with pytest.raises(ValueError, match="logprobs must be True or False"):
        engine.generate([branch], 2, logprobs=bad)
    assert engine_state(engine) == before and engine.logprobs(branch) == [None] * len(branch)


def test_decode_step_events_carry_the_logprobs_the_branches_keep(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    kids = eng.fork(eng.new_branch("root", "Events"), 2)
    steps = []
    with eng.subscribe(steps.append):
        eng.generate(kids, 3, SAMPLED, logprobs=True)
        eng.generate(kids, 1, SAMPLED)
    decoded = [event for event in steps if hasattr(event, "logprobs")]
    assert [event.logprobs is None for event in decoded] == [False, False, False, True]
    for kid in kids:
        from_events = [event.logprobs[event.branches.index(kid.name)] for event in decoded[:3]]
        assert from_events == eng.logprobs(kid)[-4:-1]


def test_the_tree_shows_each_nodes_mean_logprob(checkpoint):
    from dendrite_nb.widgets import TreeView
    from dendrite_nb.widgets.tree_view import tree_lines

    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    kids = eng.fork(eng.new_branch("root", "Scored thoughts"), 2)
    eng.generate(kids[0], 4, SAMPLED, logprobs=True)
    eng.generate(kids[1], 4, SAMPLED)
    scored = sum(eng.logprobs(kids[0])[-4:]) / 4
    nodes = {tuple(node["branches"]): node for node in eng.tree()["nodes"]}
    assert nodes[(kids[0].name,)]["mean_logprob"] == pytest.approx(scored)
    assert nodes[(kids[1].name,)]["mean_logprob"] is None
    assert any(f"mean logprob {scored:.3f} [{kids[0].name}]" in line for line in tree_lines(eng.tree()))
    view = TreeView(eng, interval_s=0)
    assert sorted(node["mean_logprob"] is None for node in view._nodes) == [False, True, True, True]


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_appended_text_is_scored_against_transformers_across_prefill_chunks(shape, checkpoint, hf_model):
    """Candidate answers forked from one question, appended together in 7-token forwards and scored."""
    eng = Engine.from_pretrained(checkpoint(shape), num_blocks=64, block_size=4, prefill_chunk_tokens=7)
    question = eng.new_branch("q", "Which way across the river?")
    short, long = eng.fork(question, 2)
    eng.append_many([(short, " Swim."), (long, " Build a raft from logs and rope, then paddle over.")],
                    logprobs=True)
    for answer in (short, long):
        scored = assert_match(eng, hf_model(shape), answer)
        assert [position for position, _ in scored] == list(range(len(question), len(answer)))
    eng.audit()


def test_a_branchs_first_token_has_nothing_to_predict_it(checkpoint, hf_model):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64)
    branch = eng.new_branch("empty")
    eng.append(branch, "Scored from the second token on", logprobs=True)
    kept = eng.logprobs(branch)
    assert kept[0] is None and None not in kept[1:]
    assert_match(eng, hf_model("llama-gqa-untied"), branch)


def test_appending_with_logprobs_that_are_not_a_bool_changes_nothing(engine):
    branch = engine.new_branch("b", "Hello")
    before = engine_state(engine)
    with pytest.raises(ValueError, match="logprobs must be True or False"):
        engine.append(branch, " world", logprobs="yes")
    assert engine_state(engine) == before
