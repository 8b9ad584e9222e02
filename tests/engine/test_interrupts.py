"""Real SIGINTs (what Kernel > Interrupt sends) wherever they land: never dropped, never leaving damage."""
import os
import random
import signal
import threading

import pytest
import torch

from dendrite_nb import Engine, GenerationInterrupted, SamplingParams
from dendrite_nb.forward import ForwardRunner
from dendrite_nb.kv.allocator import BlockAllocator
from dendrite_nb.kv.tree import BranchTree

from tests.support.engines import engine_state

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("sigint_raises")   # conftest: Python's own handler, whatever CI inherited


def ctrl_c() -> None:
    """Send this process SIGINT: delivered to the main thread before os.kill returns."""
    os.kill(os.getpid(), signal.SIGINT)


def ctrl_c_on_call(monkeypatch, owner, name: str, call: int = 1) -> dict:
    """Make the `call`-th call of owner.name (from now) send SIGINT as it starts."""
    real = getattr(owner, name)
    seen = {"n": 0}

    def interrupted(*args, **kwargs):
        seen["n"] += 1
        if seen["n"] == call:
            ctrl_c()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return seen


def fresh_logits_match(engine: Engine, checkpoint) -> None:
    """Every branch's next-token logits equal a fresh prefill of its tokens (its KV is what it should be)."""
    reference = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    for name, branch in engine.branches.items():
        if len(branch):
            reference.new_branch("r", branch.tokens)
            torch.testing.assert_close(engine.next_logits(name), reference.next_logits("r"), atol=1e-4, rtol=0)
            reference.prune("r")


def test_ctrl_c_during_the_last_step_stops_generate(engine, monkeypatch):
    """It used to be deferred to the end of the step, and then the call returned normally: the interrupt was lost."""
    kids = engine.fork(engine.new_branch("root", "The cat sat"), 2)
    ctrl_c_on_call(monkeypatch, ForwardRunner, "run", call=4)   # the 4th step, the last
    with pytest.raises(GenerationInterrupted) as interrupted:
        engine.generate(kids, 4, GREEDY)
    assert interrupted.value.steps_done == 4 and [len(out) for out in interrupted.value.outputs] == [4, 4]
    assert [len(kid) for kid in kids] == [len(engine.branch("root")) + 4] * 2   # the last step is kept
    engine.audit()
    engine.generate(kids, 1, GREEDY)   # and the engine goes on


def test_ctrl_c_mid_step_stops_at_the_end_of_that_step(engine, monkeypatch):
    kids = engine.fork(engine.new_branch("root", "The cat sat"), 2)
    ctrl_c_on_call(monkeypatch, ForwardRunner, "run", call=2)
    with pytest.raises(GenerationInterrupted) as interrupted:
        engine.generate(kids, 6, GREEDY)
    assert interrupted.value.steps_done == 2
    engine.audit()


def test_ctrl_c_during_a_long_prefill_stops_between_chunks_and_undoes_it(checkpoint, monkeypatch):
    engine = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4, prefill_chunk_tokens=4, debug=True)
    engine.new_branch("a", "The cat sat")
    before = engine_state(engine)
    seen = ctrl_c_on_call(monkeypatch, ForwardRunner, "run", call=1)
    with pytest.raises(KeyboardInterrupt):
        engine.append("a", list(range(5, 25)))   # 5 chunks of 4
    assert seen["n"] == 1   # it stopped before the second chunk
    assert engine_state(engine) == before
    engine.audit()


# Ctrl-C landing inside each operation's bookkeeping, where it used to leak blocks, keep tokens without KV or
# break the refcount audit: now the operation completes (there is no safe point inside it) and then raises.
BOOKKEEPING = {
    "prune": (BranchTree, "_detach", lambda e: e.prune("root/1")),
    "append": (BranchTree, "append", lambda e: e.append("root/0", [5, 6, 7])),
    "new_branch": (BranchTree, "add_branch", lambda e: e.new_branch("new", [5, 6, 7])),
    "preempt": (BlockAllocator, "decref", lambda e: e.preempt("root/0")),
    "fork": (BranchTree, "fork", lambda e: e.fork("root/0", 2)),
}


@pytest.mark.parametrize("operation", BOOKKEEPING)
def test_ctrl_c_inside_bookkeeping_finishes_the_call_then_raises(engine, checkpoint, monkeypatch, operation):
    owner, name, call = BOOKKEEPING[operation]
    engine.generate(engine.fork(engine.new_branch("root", "The cat sat"), 2), 5, GREEDY)
    ctrl_c_on_call(monkeypatch, owner, name)
    with pytest.raises(KeyboardInterrupt):
        call(engine)
    monkeypatch.undo()
    engine.audit()
    fresh_logits_match(engine, checkpoint)
    finished = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    finished.generate(finished.fork(finished.new_branch("root", "The cat sat"), 2), 5, GREEDY)
    call(finished)
    assert {n: b.tokens for n, b in engine.branches.items()} == {n: b.tokens for n, b in finished.branches.items()}


def test_sigints_at_random_moments_never_damage_the_engine(checkpoint):
    """A timer thread sends SIGINT at seeded random moments while a loop of operations runs."""
    engine = Engine.from_pretrained(checkpoint(), num_blocks=48, block_size=4, prefill_chunk_tokens=8, debug=True)
    rng = random.Random(0)
    interrupted = 0
    for round_ in range(30):
        timer = threading.Timer(rng.uniform(0.0, 0.03), ctrl_c)
        try:
            timer.start()
            try:
                name = f"b{round_}"
                engine.new_branch(name, list(range(3, 3 + rng.randint(1, 20))))
                kids = engine.fork(name, 2)
                engine.generate(kids, rng.randint(1, 6), SamplingParams(temperature=0.8))
                engine.prune(kids[0], name)
            finally:
                timer.cancel()
                timer.join()
        except KeyboardInterrupt:
            interrupted += 1
        engine.audit()
        if len(engine.branches) > 4:   # interrupted rounds skip their prunes: keep the pool from filling
            engine.prune(*sorted(engine.branches)[:-4])
    assert interrupted   # some landed (the timer's range covers the loop body)
    fresh_logits_match(engine, checkpoint)
