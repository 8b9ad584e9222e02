"""Continuous batching (Engine.batch()): rows join a running decode loop between steps, each with its own settings,
decode exactly as they would alone, say why they stopped, and leave when they stop or are pruned."""
import pytest
import torch

from dendrite_nb import DendriteError, Engine, SamplingParams
from tests.support.engines import engine_state, refused

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def eng(checkpoint):
    return Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4, debug=True)


def alone(checkpoint, prompt, tokens, sampling, **generate):
    """What a fresh engine generates for one branch on its own."""
    solo = Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4)
    branch = solo.new_branch("b", prompt)
    return solo.generate([branch], tokens, sampling, **generate)[0]


def drain(batch):
    """Step until no row runs; the outputs and finish reasons of every row ended on the way."""
    outputs, reasons = {}, {}
    while (done := batch.step()) is not None:
        for row, why in done.ended.items():
            outputs[row], reasons[row] = batch.output(row), why
    return outputs, reasons


def test_rows_that_join_late_decode_as_they_would_alone(eng, checkpoint):
    sampled = SamplingParams(temperature=0.9, top_k=20)
    batch = eng.batch()
    first = batch.join([eng.new_branch("a", "one two three")], 12, GREEDY)
    batch.step()
    batch.step()
    later = batch.join([eng.new_branch("b", "four five"), eng.new_branch("c", "six")], 9, sampled)
    outputs, reasons = {}, {}
    while (done := batch.step()) is not None:
        assert len(done.rows) == batch.pending + len(done.ended)   # every running row shares the step
        for row, why in done.ended.items():
            outputs[row], reasons[row] = batch.output(row), why
    assert outputs[first[0]] == alone(checkpoint, "one two three", 12, GREEDY)
    assert outputs[later[0]] == alone(checkpoint, "four five", 9, sampled)
    solo = Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4)
    solo.new_branch("c", "six")
    assert outputs[later[1]] == solo.generate(["c"], 9, sampled)[0]   # the seed derives from the branch's name
    assert reasons == {first[0]: "max_tokens", later[0]: "max_tokens", later[1]: "max_tokens"}
    assert eng.branch("a").finish_reason == "max_tokens"
    eng.audit()


def test_each_row_says_why_it_stopped(eng):
    branch = eng.new_branch("a", "one two three")
    greedy = eng.generate([eng.fork(branch, names=["probe"])[0]], 6, GREEDY)[0]
    eng.prune("probe")
    eng.eos_token_ids = {greedy[3]}
    batch = eng.batch()
    rows = batch.join([branch], 6, GREEDY)
    outputs, reasons = drain(batch)
    assert outputs[rows[0]] == greedy[:greedy.index(greedy[3]) + 1]
    assert reasons[rows[0]] == "eos" == eng.branch("a").finish_reason


def test_stop_strings_and_grammars_report_their_reason(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=512, block_size=16)
    eng.new_branch("free", "Say yes or no:")
    eng.fork("free", names=["json"])
    text = eng.decode(eng.generate([eng.fork("free", names=["probe"])[0]], 8, GREEDY)[0])
    stop = next((ch for ch in text if ch.strip()), None)
    batch = eng.batch()
    free = batch.join(["free"], 8, SamplingParams(temperature=0.0, stop=(stop,)))
    json_row = batch.join(["json"], 64, GREEDY, {"choices": ["yes", "no"]})
    _, reasons = drain(batch)
    assert reasons[free[0]] == "stop_string"
    assert reasons[json_row[0]] == "grammar_complete"
    assert eng.text("json").endswith(("yes", "no"))


def test_top_logprobs_are_the_models_most_likely_tokens(eng):
    branch = eng.new_branch("a", "one two three")
    expected = torch.log_softmax(eng.next_logits([branch])[0].double(), -1)
    batch = eng.batch()
    plain, scored = batch.join([eng.fork(branch, names=["plain"])[0]], 1, GREEDY), None
    scored = batch.join([branch], 1, GREEDY, logprobs=True, top_logprobs=5)
    done = batch.step()
    by_row = dict(zip(done.rows, done.top_logprobs))
    assert by_row[plain[0]] is None
    top = by_row[scored[0]]
    values, ids = expected.topk(5)
    assert [token for token, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
    assert eng.logprobs(branch)[-1] == pytest.approx(values[0].item(), abs=1e-4)
    assert eng.logprobs("plain")[-1] is None   # only the rows that asked keep theirs


def test_a_pruned_row_leaves_and_the_others_go_on(eng, checkpoint):
    batch = eng.batch()
    rows = batch.join([eng.new_branch("a", "one two"), eng.new_branch("b", "three four")], 8, GREEDY)
    batch.step()
    eng.prune("a")   # between steps, as a client that hangs up does
    outputs, _ = drain(batch)
    assert rows[0] not in outputs
    assert outputs[rows[1]] == alone(checkpoint, "three four", 8, GREEDY)
    eng.audit()
    assert "a" not in eng.branches


def test_bad_joins_change_nothing(eng):
    batch = eng.batch()
    eng.new_branch("a", "one two")
    batch.join(["a"], 4, GREEDY)
    refused(eng, lambda: batch.join(["a"], 4, GREEDY), DendriteError, "decoding in this batch already")
    refused(eng, lambda: batch.join(["nope"], 4, GREEDY), DendriteError, "no branch named")
    refused(eng, lambda: batch.join(["a"], 0, GREEDY), ValueError, "max_new_tokens")
    refused(eng, lambda: batch.join(["a"], 4, GREEDY, top_logprobs=21), ValueError, "top_logprobs")
    eng.new_branch("empty")
    refused(eng, lambda: batch.join(["empty"], 4, GREEDY), DendriteError, "no tokens")
    assert batch.pending == 1


def test_a_failed_step_undoes_only_itself(eng, monkeypatch):
    batch = eng.batch()
    batch.join([eng.new_branch("a", "one two"), eng.new_branch("b", "three")], 8, GREEDY)
    batch.step()
    before = engine_state(eng)
    real_run = eng._runner.run

    def failing(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(eng._runner, "run", failing)
    with pytest.raises(RuntimeError, match="fell over"):
        batch.step()
    assert engine_state(eng) == before
    eng.audit()
    monkeypatch.setattr(eng._runner, "run", real_run)
    outputs, _ = drain(batch)   # the rows go on from where the last good step left them
    assert all(len(tokens) == 8 for tokens in outputs.values())


def test_reseed_makes_a_branch_sample_as_its_seed_says(eng):
    sampled = SamplingParams(temperature=1.0)
    a, b = eng.fork(eng.new_branch("root", "one two three"), names=["a", "b"])
    eng.reseed(a, 7)
    eng.reseed(b, 7)
    first, second = eng.generate([a, b], 12, sampled)
    assert first == second   # different names, one seed
    refused(eng, lambda: eng.reseed(a, -1), ValueError, "seed")
    refused(eng, lambda: eng.reseed("nope", 1), DendriteError, "no branch named")


def test_a_row_the_batch_never_had_is_refused_by_name(eng):
    """output(99) and branch(99) raised a bare IndexError; leave([99]) and leave("a") were taken silently."""
    batch = eng.batch()
    with pytest.raises(ValueError, match="none yet"):
        batch.output(0)
    rows = batch.join([eng.new_branch("rows", [1, 2, 3])], 2, SamplingParams(temperature=0.0))
    batch.step()
    for call in (lambda: batch.output(99), lambda: batch.branch(-1), lambda: batch.leave([0, 99]),
                 lambda: batch.output(True)):
        with pytest.raises(ValueError, match=r"is not a row of this batch; its rows are 0 to 0"):
            call()
    with pytest.raises(TypeError, match="list of rows"):
        batch.leave("a")
    assert batch.pending_rows == frozenset(rows) and len(batch.output(0)) == 1
