"""The workers of a tensor-parallel engine live exactly as long as it does: close() ends them and frees the port and
the groups (a second engine starts right after, in the same process), and a killed worker is a clear error on the
next call, within 30 s, that leaves the tree as it was."""
import multiprocessing
import os
import signal
import socket
import time

import pytest

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.distributed.channels import HOST
from dendrite_nb.distributed.group import JOIN_TIMEOUT_S
from dendrite_nb.errors import TensorParallelError
from dendrite_nb.testing import TINY_SHAPES
from tests.support.engines import engine_state

CONFIG = TINY_SHAPES["qwen3-gqa-tied"].hf_config(vocab_size=128)
GREEDY = SamplingParams(temperature=0.0)


def children() -> set[int]:
    return {child.pid for child in multiprocessing.active_children()}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_ends_the_workers_and_a_second_engine_starts_right_after():
    first = Engine.from_random(CONFIG, num_blocks=16, tensor_parallel=2)
    pids, port = first._tensor_group.pids, first._tensor_group.port
    assert set(pids) <= children()
    first.new_branch("a", [1, 2, 3])
    tokens = first.generate(["a"], 8, GREEDY)
    first.close()
    assert not set(pids) & children() and all(gone(pid) for pid in pids)
    with socket.socket() as probe:   # the store's port is free again
        probe.bind((HOST, port))
    second = Engine.from_random(CONFIG, num_blocks=16, tensor_parallel=2)
    try:
        second.new_branch("a", [1, 2, 3])
        assert second.generate(["a"], 8, GREEDY) == tokens
    finally:
        second.close()
    assert not set(second._tensor_group.pids) & children()


def test_a_killed_worker_is_a_clear_error_on_the_next_call():
    engine = Engine.from_random(CONFIG, num_blocks=16, tensor_parallel=2)
    try:
        engine.new_branch("a", [1, 2, 3])
        engine.generate(["a"], 4, GREEDY)
        before = engine_state(engine)
        (pid,) = engine._tensor_group.pids
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) was killed by signal SIGKILL.*close it "
                                                      rf"and load it again"):
            engine.generate(["a"], 4, GREEDY)
        assert time.monotonic() - started < 30
        assert engine_state(engine) == before   # the failed call changed nothing
        with pytest.raises(TensorParallelError, match="SIGKILL"):   # and so does every later one
            engine.append("a", [4])
        assert engine_state(engine) == before
    finally:
        engine.close()
    assert not set(engine._tensor_group.pids) & children()


def test_rank_0_failing_inside_a_forward_ends_the_workers(monkeypatch):
    """Rank 0 raising between two all-reduces leaves the workers inside the forward: their next collective would
    pair with the wrong one of rank 0's, so they are ended, and every later call says why."""
    engine = Engine.from_random(CONFIG, num_blocks=16, tensor_parallel=2)
    try:
        engine.new_branch("a", [1, 2, 3])
        before, pids = engine_state(engine), engine._tensor_group.pids

        def out_of_memory(x):
            raise MemoryError("no memory for the second layer")

        monkeypatch.setattr(engine.model.model.layers[1].input_layernorm, "forward", out_of_memory)
        with pytest.raises(MemoryError, match="second layer"):
            engine.generate(["a"], 4, GREEDY)
        monkeypatch.undo()
        assert engine_state(engine) == before and all(gone(pid) for pid in pids)
        with pytest.raises(TensorParallelError, match=r"rank 0 stopped in the middle of a forward \(MemoryError: no "
                                                      r"memory for the second layer\)"):
            engine.generate(["a"], 4, GREEDY)
    finally:
        engine.close()


def test_ctrl_c_in_a_quantized_load_ends_the_workers_and_the_next_load_works(monkeypatch):
    """Ctrl-C between two of a quantized load's scale exchanges leaves the workers inside the load, where no close
    command reaches them: the load ends them at once (not after a close's timeouts: this took 22 s), frees the
    store's port, and raises the KeyboardInterrupt; the next load starts afresh."""
    from dendrite_nb.distributed import launch

    quantize, started, groups, make_group = launch.quantize_shard, {}, [], launch.TensorGroup
    monkeypatch.setattr(launch, "TensorGroup", lambda *args: groups.append(make_group(*args)) or groups[-1])

    def interrupted_after_one_exchange(model, weights, max_over_ranks):
        started["pids"] = set(children())
        calls = []

        def exchange(tensor):
            if calls:
                started["interrupt"] = time.monotonic()
                raise KeyboardInterrupt
            calls.append(tensor)
            return max_over_ranks(tensor)
        quantize(model, weights, exchange)

    monkeypatch.setattr(launch, "quantize_shard", interrupted_after_one_exchange)
    with pytest.raises(KeyboardInterrupt):
        Engine.from_random(CONFIG, num_blocks=16, weights="int8", tensor_parallel=2)
    assert time.monotonic() - started["interrupt"] < JOIN_TIMEOUT_S   # one close command's wait is this long
    assert started["pids"] and all(gone(pid) for pid in started["pids"]) and not children()
    with socket.socket() as probe:   # the store's port is free again
        probe.bind((HOST, groups[0].port))
    monkeypatch.undo()
    engine = Engine.from_random(CONFIG, num_blocks=16, weights="int8", tensor_parallel=2)
    try:
        engine.new_branch("a", [1, 2, 3])
        assert len(engine.generate(["a"], 4, GREEDY)[0]) == 4
    finally:
        engine.close()
