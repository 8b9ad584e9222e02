"""One owner per engine: a second thread waits for the running call; listeners act at step boundaries.

A listener (DecodeStep) runs on the engine's thread between steps, where the step is committed: it may prune,
fork, re-rank or constrain branches, and the running generate goes on from the next step with the change.
"""
import re
import threading

import pytest
import torch

from dendrite_nb import DecodeStep, DendriteError, Engine, SamplingParams

from tests.support.engines import results_of_threads

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture
def eng(checkpoint):
    return Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4, debug=True)


def on_step(engine: Engine, step: int, action):
    """Subscribe `action(event)` to run once, at the end of decode step `step`."""
    def listener(event):
        if isinstance(event, DecodeStep) and event.step == step:
            action(event)
    return engine.subscribe(listener)


def test_a_second_thread_waits_for_the_running_generate(eng):
    """Its prune used to land mid-call: a bare AttributeError from the decode loop, or nothing at all."""
    kids = eng.fork(eng.new_branch("root", "The cat sat"), 3)
    started, outcome = threading.Event(), {}

    def prune_from_another_thread():
        started.set()
        outcome["freed"] = eng.prune("root/1")

    other = threading.Thread(target=prune_from_another_thread)
    with on_step(eng, 1, lambda event: (other.start(), started.wait(10))):
        outputs = eng.generate(kids, 8, GREEDY)
    other.join(30)
    assert [len(out) for out in outputs] == [8, 8, 8]   # the call ran to its end with all three
    assert "root/1" not in eng.branches and outcome["freed"] > 0   # then the prune ran
    eng.audit()


def test_two_threads_generating_get_the_tokens_of_two_calls_in_a_row(checkpoint):
    def decode(engine, name):
        return engine.generate([name], 12, GREEDY)[0]

    sequential = Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4)
    concurrent = Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4)
    for engine in (sequential, concurrent):
        engine.new_branch("x", "The cat sat")
        engine.new_branch("y", "A dog ran")
    expected = [decode(sequential, name) for name in ("x", "y")]
    assert results_of_threads([lambda: decode(concurrent, "x"), lambda: decode(concurrent, "y")]) == expected
    concurrent.audit()


def test_a_listener_that_prunes_a_decoding_branch_drops_it_from_the_call(eng):
    """It used to break the call."""
    kids = eng.fork(eng.new_branch("root", "The cat sat"), 3)
    with on_step(eng, 2, lambda event: eng.prune("root/1")):
        outputs = eng.generate(kids, 6, GREEDY)
    assert [len(out) for out in outputs] == [6, 3, 6]   # the pruned one kept its first 3 steps' tokens
    assert sorted(eng.branches) == ["root", "root/0", "root/2"]
    eng.audit()
    reference = Engine.from_pretrained(eng.source["checkpoint"], num_blocks=64, block_size=4)
    for name in ("root/0", "root/2"):
        reference.new_branch(name, eng.branch(name).tokens)
        torch.testing.assert_close(eng.next_logits(name), reference.next_logits(name), atol=1e-4, rtol=0)


def test_a_listener_may_fork_and_re_rank_between_steps(eng):
    kids = eng.fork(eng.new_branch("root", "The cat sat"), 2)
    forked = {}
    with on_step(eng, 1, lambda event: forked.update(branches=eng.fork("root/0", 2))), \
            on_step(eng, 2, lambda event: eng.set_priority("root/1", 5.0)):
        eng.generate(kids, 5, GREEDY, max_batch=1)
    length_then = len(eng.branch("root")) + 2
    assert [len(b) for b in forked["branches"]] == [length_then] * 2   # the forks hold the first 2 steps
    assert forked["branches"][0].tokens == eng.branch("root/0").tokens[:length_then]
    eng.audit()


def test_a_constraint_a_listener_adds_holds_from_the_next_step(eng):
    """It used to be half applied: the call never masked or advanced the new grammar."""
    root = eng.new_branch("root", "The answer is")
    grammar = "(yes|no)+"
    with on_step(eng, 1, lambda event: eng.constrain("root", {"regex": grammar})):
        eng.generate([root], 10, SamplingParams(temperature=1.0, seed=3))
    after = root.tokens[root.constraint_from:]
    text = eng.decode(after, skip_end_tokens=True)
    assert after and re.fullmatch(r"(yes|no)*(y|ye|n)?", text), text
    eng.audit()


def test_a_constraint_a_listener_lifts_stops_masking_from_the_next_step(eng):
    root = eng.new_branch("root", "The answer is")
    eng.constrain(root, {"regex": "(yes|no)+"})
    with on_step(eng, 0, lambda event: eng.constrain("root", None)):
        outputs = eng.generate([root], 12, SamplingParams(temperature=1.0, seed=3, ignore_eos=True))
    assert len(outputs[0]) == 12 and root.matcher is None   # no grammar stopped it
    eng.audit()


def test_a_listener_cannot_start_a_second_generate_or_close_the_engine(eng):
    kids = eng.fork(eng.new_branch("root", "The cat sat"), 2)
    with on_step(eng, 1, lambda event: eng.generate(["root"], 2)):
        with pytest.raises(DendriteError, match=r"generate\(\) cannot run while generate\(\) is running"):
            eng.generate(kids, 5, GREEDY)
    assert [len(kid) for kid in kids] == [len(eng.branch("root")) + 2] * 2   # the 2 steps done stay
    with on_step(eng, 0, lambda event: eng.close()):
        with pytest.raises(DendriteError, match=r"close\(\) cannot run while generate\(\) is running"):
            eng.generate(kids, 3, GREEDY)
    eng.audit()
    eng.generate(kids, 1, GREEDY)


def test_tree_events_reach_listeners_only_after_the_change_is_committed(eng):
    seen = []

    def listener(event):
        seen.append(event.reason)
        eng.audit()   # consistent whenever a listener looks
        raise RuntimeError("a listener's bug")

    eng.new_branch("root", "The cat sat")
    with eng.subscribe(listener):
        with pytest.raises(RuntimeError, match="a listener's bug"):
            eng.fork("root", 2)
    assert seen == ["fork"] and sorted(eng.branches) == ["root", "root/0", "root/1"]   # the fork stayed
    eng.audit()
