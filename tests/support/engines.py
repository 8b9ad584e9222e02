"""Helpers that drive or inspect an Engine the same way in many test files."""
import sys
import threading

import pytest
import torch

from dendrite_nb.testing import TINY_SHAPES

ALL_SHAPES = list(TINY_SHAPES)


def engine_state(eng):
    """Everything a bad call must leave unchanged."""
    return eng.tree(), eng.block_table(), eng.num_free_blocks


def refused(engine, call, errors, message):
    """`call()` raises one of `errors` matching `message`, and the engine is exactly as it was."""
    before = engine_state(engine)
    with pytest.raises(errors, match=message):
        call()
    assert engine_state(engine) == before
    engine.audit()


def decode_recording_logits(eng, branch, steps, sampling):
    """Decode one token at a time; returns the next-token logits seen before each step, [steps, vocab] on CPU."""
    logits = []
    for _ in range(steps):
        logits.append(eng.next_logits([branch])[0].cpu())
        eng.generate([branch], 1, sampling)
    return torch.stack(logits)


def interrupt_forward_call(monkeypatch, eng, call: int) -> None:
    """Make the model's `call`-th forward from now raise KeyboardInterrupt (Ctrl-C in the middle of a step)."""
    calls = {"n": 0}
    real_forward = type(eng.model).forward

    def flaky_forward(self, *args):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real_forward(self, *args)

    monkeypatch.setattr(type(eng.model), "forward", flaky_forward)


def results_of_threads(calls, timeout_s: float = 120) -> list:
    """Run each zero-argument call on its own thread, all at once; their results in order (None if one raised).
    The interpreter switches threads every microsecond meanwhile (not every 5 ms), so that unguarded calls
    would interleave inside a decode step, not only between whole calls."""
    results = [None] * len(calls)

    def run(index):
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
    finally:
        sys.setswitchinterval(interval)
    return results
