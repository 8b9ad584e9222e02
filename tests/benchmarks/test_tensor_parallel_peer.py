"""benchmarks/tensor_parallel.py's llama.cpp rows (--llama-gguf) and the workload behind them (peers/workloads.py
SteadyDecode): every run decodes fresh copies of the same leaves, so each run starts from the same contexts and
gives the same greedy tokens, and the copies are pruned after it; the script's smoke run adds llama.cpp's step
(CPU wheel) beside the engine's. The llama.cpp tests are skipped, saying so, where llama-cpp-python is not
installed."""
from __future__ import annotations

import pytest

NO_LLAMA = "llama-cpp-python is not installed (pip install llama-cpp-python)"
pytestmark = pytest.mark.usefixtures("benchmarks_on_path")


def workload(steps: int = 3):
    from bench_common import random_ids
    from peers.workloads import SteadyDecode

    return SteadyDecode(random_ids(40, 256, seed=1), random_ids(4, 256, seed=2, rows=3), steps)


def test_steady_decode_runs_every_copy_from_the_same_contexts():
    from bench_common import SMOKE_VOCAB
    from peers.systems import EngineSystem

    from dendrite_nb import Engine
    from dendrite_nb.testing import TINY_SHAPES

    engine = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(**SMOKE_VOCAB), device="cpu",
                                num_blocks=64, block_size=16)
    system, steady = EngineSystem(engine, "engine"), workload()
    leaves = steady.prepare(system)
    before = len(engine.branches)
    first_figures, first = steady.run(system, leaves)
    second_figures, second = steady.run(system, leaves)
    assert first == second and len(first) == 3 * 3   # three leaves, three tokens each
    assert len(engine.branches) == before   # the copies are pruned
    assert first_figures["step"] > 0 and second_figures["step"] > 0
    assert steady.sequences() == 1 + 2 * 3 and steady.cells() >= 40 + 3 * 4 + 3 * 3


def test_a_steady_decode_of_fewer_than_two_steps_is_refused():
    with pytest.raises(ValueError, match="steps must be at least 2"):
        workload(steps=1)


def test_smoke_run_adds_llama_cpps_step_beside_the_engines(tmp_path):
    pytest.importorskip("llama_cpp", reason=NO_LLAMA)
    import tensor_parallel
    from peers.random_gguf import main as write_gguf

    gguf = write_gguf(["--shape", "llama-3.1-8b", "--smoke", "--type", "f32", "--out", str(tmp_path / "m.gguf")])
    payload = tensor_parallel.main(["--smoke", "--llama-gguf", str(gguf), "--llama-splits", "none", "layer"])
    rows = {row["variant"]: row for row in payload["tables"][0]["rows"]}
    assert list(rows) == ["TP=1", "TP=2", "llama.cpp, CPU"]   # no split on the CPU: "none" alone runs
    assert rows["llama.cpp, CPU"]["step_ms"] > 0 and rows["llama.cpp, CPU"]["x_tp1"] > 0
    assert sum(note.startswith("llama.cpp, CPU: flash attention") for note in payload["notes"]) == 1
    against_target = [note.split(":")[0] for note in payload["notes"] if "the TP=1 step (target" in note]
    assert against_target == ["TP=2"]   # llama.cpp's rows are the peer, not the engine's target


def test_an_unknown_split_is_refused_before_llama_cpp_loads_anything(tmp_path):
    pytest.importorskip("llama_cpp", reason=NO_LLAMA)
    from peers.llama_cpp_peer import LlamaCppModel

    with pytest.raises(ValueError, match="split 'diagonal' is not one of"):
        LlamaCppModel(tmp_path / "absent.gguf", 0, "diagonal")
