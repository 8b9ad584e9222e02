"""Engine events (what live views and streaming read) and interrupts that stop at a step boundary."""
import signal

import pytest

from dendrite_nb import DecodeStep, GenerationInterrupted, SamplingParams, TreeChanged

from tests.support.engines import engine_state

SAMPLED = SamplingParams(temperature=1.0, ignore_eos=True)


def test_listener_sees_each_step_and_each_tree_change(engine):
    events = []
    with engine.subscribe(events.append):
        root = engine.new_branch("root", "The cat sat")
        kids = engine.fork(root, 2)
        outs = engine.generate(kids, 5, SAMPLED)
        engine.prune(kids[1])
    engine.generate([kids[0]], 1, SAMPLED)  # after close(): no more events

    steps = [e for e in events if isinstance(e, DecodeStep)]
    assert [s.step for s in steps] == list(range(5))
    assert all(s.branches == ("root/0", "root/1") and s.batch_size == 2 and s.step_s > 0 for s in steps)
    assert [list(t) for t in zip(*(s.tokens for s in steps))] == outs
    changes = [(e.reason, e.branches) for e in events if isinstance(e, TreeChanged)]
    assert changes == [("new_branch", ("root",)), ("fork", ("root", "root/0", "root/1")),
                       ("generate", ("root/0", "root/1")), ("prune", ("root/1",))]


def test_finished_branches_are_reported_at_the_step_they_stop(engine):
    root = engine.new_branch("root", "The cat sat")
    greedy_first = engine.next_logits([root])[0].argmax().item()
    engine.eos_token_ids = frozenset({greedy_first})
    events = []
    with engine.subscribe(events.append):
        engine.generate([root], 4, SamplingParams(temperature=0.0))
    steps = [e for e in events if isinstance(e, DecodeStep)]
    assert len(steps) == 1 and steps[0].finished == ("root",)


def test_interrupt_from_a_listener_keeps_completed_steps_and_continues_exactly(engine, checkpoint):
    from dendrite_nb import Engine

    def interrupt_at_step_3(event):
        if isinstance(event, DecodeStep) and event.step == 2:
            raise KeyboardInterrupt

    root = engine.new_branch("root", "Once upon a time")
    kids = engine.fork(root, 3)
    with engine.subscribe(interrupt_at_step_3), pytest.raises(GenerationInterrupted) as caught:
        engine.generate(kids, 8, SAMPLED)
    assert caught.value.steps_done == 3 and isinstance(caught.value, KeyboardInterrupt)
    assert [len(o) for o in caught.value.outputs] == [3, 3, 3]
    for kid, out in zip(kids, caught.value.outputs):
        assert kid.tokens == root.tokens + out
    engine.audit()
    rest = engine.generate(kids, 5, SAMPLED)  # the next call works and continues the same random streams

    reference = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    ref_root = reference.new_branch("root", "Once upon a time")
    uninterrupted = reference.generate(reference.fork(ref_root, 3), 8, SAMPLED)
    assert [a + b for a, b in zip(caught.value.outputs, rest)] == uninterrupted


def test_sigint_in_the_middle_of_a_forward_stops_after_that_step(engine, monkeypatch, sigint_raises):
    root = engine.new_branch("root", "Once upon a time")
    calls = {"n": 0}
    real_forward = engine._runner.run   # every forward, prefill chunks and decode steps, runs through it

    def forward_with_ctrl_c_on_step_2(planned, token_ids):
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGINT)  # what Kernel > Interrupt delivers, mid-forward
        real_forward(planned, token_ids)

    monkeypatch.setattr(engine._runner, "run", forward_with_ctrl_c_on_step_2)
    with pytest.raises(GenerationInterrupted) as caught:
        engine.generate([root], 8, SAMPLED)
    assert caught.value.steps_done == 2  # the step that was running when the signal came completed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engine.audit()


def test_interrupt_inside_a_forward_undoes_only_that_step(engine, monkeypatch):
    root = engine.new_branch("root", "Once upon a time")
    kids = engine.fork(root, 2)
    calls = {"n": 0}
    real_forward = engine._runner.run

    def forward_interrupted_on_call_4(planned, token_ids):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        real_forward(planned, token_ids)

    monkeypatch.setattr(engine._runner, "run", forward_interrupted_on_call_4)
    with pytest.raises(GenerationInterrupted) as caught:
        engine.generate(kids, 8, SAMPLED)
    assert caught.value.steps_done == 3
    assert [len(k) - len(root) for k in kids] == [3, 3]
    engine.audit()
    monkeypatch.undo()
    assert [len(o) for o in engine.generate(kids, 2, SAMPLED)] == [2, 2]
    engine.audit()


def test_a_bad_listener_is_refused_and_changes_nothing(engine):
    engine.new_branch("root", "x")
    before = engine_state(engine)
    with pytest.raises(TypeError, match="callable"):
        engine.subscribe("not a function")
    assert engine_state(engine) == before


def test_a_subscription_says_what_it_delivers_to_and_whether_it_still_does(engine):
    def on_step(event):
        pass
    subscription = engine.subscribe(on_step)
    assert repr(subscription).startswith("Subscription(") and repr(subscription).endswith(".on_step, delivering)")
    subscription.close()
    assert repr(subscription).endswith(", closed)")
