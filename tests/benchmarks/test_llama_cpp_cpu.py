"""benchmarks/llama_cpp_cpu.py and its parts (benchmarks/peers/): the llama.cpp peer's sequence bookkeeping and
greedy decoding on the real demo model, GGUF copies in other weight types, and the whole script in --quick mode
(no timing is checked: that every workload ran on both systems and the tables are consistent). Skipped, saying so,
where llama-cpp-python is not installed."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")

PROMPT = "Rivers carve their valleys slowly, one grain at a time. The oldest"

pytestmark = pytest.mark.usefixtures("benchmarks_on_path")


@pytest.fixture(scope="module")
def llama_model(real_gguf):
    from peers.llama_cpp_peer import LlamaCppModel

    return LlamaCppModel(real_gguf)


@pytest.fixture
def peer(llama_model):
    from peers.llama_cpp_peer import LlamaCppPeer, LlamaSetting

    made = LlamaCppPeer(llama_model, LlamaSetting(threads=1, flash_attn=False, kv_type="f32"), n_ctx=512, n_seq_max=3)
    yield made
    made.close()


def test_a_refused_context_says_what_flash_attention_would_need(llama_model):
    from peers.llama_cpp_peer import LlamaCppError, LlamaCppPeer, LlamaSetting

    with pytest.raises(LlamaCppError, match="a quantized V cache needs flash attention on"):
        LlamaCppPeer(llama_model, LlamaSetting(threads=1, flash_attn=False, kv_type="q8_0"), n_ctx=512, n_seq_max=1)


def test_forks_continue_their_parent_and_ids_come_back_when_pruned(peer):
    from peers.llama_cpp_peer import LlamaCppError

    parent = peer.new_sequence()
    prompt = peer.tokenize(PROMPT)
    peer.feed([(parent, prompt)])
    kids = peer.fork(parent, 2)
    assert peer.num_free_ids == 0
    with pytest.raises(LlamaCppError, match="n_seq_max 3"):
        peer.fork(parent, 1)
    assert peer.num_free_ids == 0   # the refused fork took nothing
    # Both children hold the parent's cells: greedily they continue as the parent itself does.
    from_kids = peer.generate(kids, 6)
    assert from_kids[0] == from_kids[1]
    assert peer.generate([parent], 6) == [from_kids[0]]
    assert all(kid.length == len(prompt) + 5 and kid.pending == [from_kids[0][-1]] for kid in kids)
    peer.prune(kids)
    assert peer.num_free_ids == 2
    with pytest.raises(LlamaCppError, match="not live"):
        peer.generate(kids[:1], 1)


def test_one_feed_of_several_sequences_equals_feeding_each_alone(peer):
    prompts = [peer.tokenize(PROMPT), peer.tokenize("A bridge is a small argument with a river, and")]
    alone = []
    for prompt in prompts:
        sequence = peer.new_sequence()
        (first,) = peer.feed([(sequence, prompt)])
        alone.append((first, peer.generate([sequence], 4)[0]))
        peer.prune([sequence])
    together = [peer.new_sequence() for _ in prompts]
    firsts = peer.feed(list(zip(together, prompts)))
    assert list(zip(firsts, peer.generate(together, 4))) == alone


def test_a_prune_keeps_what_other_sequences_hold(peer):
    parent = peer.new_sequence()
    peer.feed([(parent, peer.tokenize(PROMPT))])
    (kid,) = peer.fork(parent, 1)
    expected = peer.generate([kid], 5)
    peer.prune([kid])
    (again,) = peer.fork(parent, 1)
    peer.prune([parent])
    assert peer.generate([again], 5) == expected   # the shared cells are the child's now


def test_bad_feeds_are_refused(peer):
    sequence = peer.new_sequence()
    with pytest.raises(ValueError, match="at least one token"):
        peer.feed([(sequence, [])])
    with pytest.raises(ValueError, match="empty"):
        peer.generate([sequence], 1)
    with pytest.raises(ValueError, match="twice"):
        peer.feed([(sequence, [1]), (sequence, [2])])
    assert sequence.length == 0 and sequence.next_token is None


def metadata(reader: GGUFReader) -> dict:
    """Every field but the file's header and its weight type."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.") and name != "general.file_type"}


def test_gguf_copies_hold_the_same_weights_and_metadata(tmp_path):
    from peers.gguf_copies import gguf_copy

    from dendrite_nb.testing import write_tiny_checkpoint
    from dendrite_nb.testing.gguf_writer import write_gguf

    source = write_gguf(write_tiny_checkpoint(tmp_path / "hf", "llama-gqa-untied"), tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    original = GGUFReader(source)
    for kind, tolerance in (("f32", 0.0), ("bf16", 1e-2), ("q8_0", 0.0)):
        path = gguf_copy(source, kind, tmp_path / "copies")
        copy = GGUFReader(path)
        assert metadata(copy) == metadata(original)
        assert [t.name for t in copy.tensors] == [t.name for t in original.tensors]
        for theirs, ours in zip(copy.tensors, original.tensors):
            want = dequantize(ours.data, ours.tensor_type)
            got = dequantize(theirs.data, theirs.tensor_type)
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
        written = path.stat().st_mtime_ns
        assert gguf_copy(source, kind, tmp_path / "copies") == path and path.stat().st_mtime_ns == written
    with pytest.raises(ValueError, match="q4_0"):
        gguf_copy(source, "q4_0", tmp_path / "copies")


class FakeSystem:
    """A system whose workload run takes the time its variant was given (no model): for the sweep's logic."""

    def __init__(self, label, seconds, order):
        self.label, self.seconds, self.order = label, seconds, order

    def root(self, tokens):
        return object()

    def fork(self, handle, n):
        return [object() for _ in range(n)]

    def extend(self, items):
        pass

    def generate(self, handles, max_new_tokens):
        return [[7] * max_new_tokens for _ in handles]

    def prune(self, handles):
        pass

    def reset(self):
        pass

    def close(self):
        pass


def fake_workload():
    from peers.workloads import Metric, Workload

    class Fake(Workload):
        name, metrics = "fake", [Metric("t", "t", [])]

        def run(self, system, state):
            system.order.append(system.label)
            return {"t": system.seconds, "t_cpu": system.seconds}, [1, 2]

    return Fake()


def fake_variants(llama_seconds, order):
    from peers.llama_cpp_peer import LlamaCppError
    from peers.sweep import Variant

    def llama(file, setting):
        def open_(workload):
            seconds = llama_seconds.get((file, setting.threads, setting.flash_attn, setting.kv_type), 10.0)
            if seconds is None:
                raise LlamaCppError("refused")
            return FakeSystem("llama", seconds, order)
        return Variant("llama.cpp", f"{file}, {setting.describe()}", 1.0, open_, True)

    engine = Variant("engine", "float32", 1.0, lambda workload: FakeSystem("engine", 5.0, order), False)
    return engine, llama


def test_the_sweep_searches_llama_settings_knob_by_knob_then_alternates_the_best():
    from peers.quiet import Guard
    from peers.sweep import run_workload
    from peers.workloads import Texts

    texts = Texts([1] * 40, [[1]] * 4, [1], [[1]], [[1]], [[1]])
    timings = {("q4_1", 2, False, "f16"): 10.0, ("f32", 2, False, "f16"): 8.0,   # f32 is the faster file
               ("f32", 1, False, "f16"): 7.0, ("f32", 2, True, "f16"): 7.5,     # fewer threads and FA on help
               ("f32", 2, False, "f32"): None,                                   # refused: never the best
               ("f32", 1, True, "f16"): 6.0}                                     # both helping changes together
    order = []
    engine, llama = fake_variants(timings, order)
    knobs = {"threads": [2, 1], "flash_attn": [False, True], "kv_type": ["f16", "f32"]}
    outcome = run_workload(fake_workload(), texts, [engine], ["q4_1", "f32"], knobs, llama, repeats=3,
                           full_grid=False, guard=Guard(attempts=1), log=lambda line: None)
    settings = [t.variant.setting for t in outcome.trials]
    assert settings == ["float32", "q4_1, 2 threads, FA off, KV f16", "f32, 2 threads, FA off, KV f16",
                        "f32, 1 thread, FA off, KV f16", "f32, 2 threads, FA on, KV f16",
                        "f32, 2 threads, FA off, KV f32", "f32, 1 thread, FA on, KV f16"]
    assert outcome.trials[5].unavailable == "refused" and not outcome.trials[5].runs
    assert outcome.best["llama.cpp"].variant.setting == "f32, 1 thread, FA on, KV f16"
    assert [len(outcome.best[s].runs) for s in ("engine", "llama.cpp")] == [3, 3]
    # After the sweep (one run per variant), the two best alternate, one run at a time.
    assert order[-4:] == ["engine", "llama", "engine", "llama"]


def test_the_full_grid_runs_every_combination():
    from peers.quiet import Guard
    from peers.sweep import llama_search
    from peers.workloads import Texts

    order = []
    _, llama = fake_variants({}, order)
    trials = llama_search(fake_workload(), Texts([1] * 40, [[1]] * 4, [1], [[1]], [[1]], [[1]]), ["q4_1", "f32"],
                          {"threads": [2, 1], "flash_attn": [False, True], "kv_type": ["f16"]}, llama, True,
                          Guard(attempts=1), lambda line: None)
    assert len({t.variant.setting for t in trials}) == len(trials) == 8


def scripted_load(monkeypatch, others_cores):
    """quiet.sample() as a machine where the rest used others_cores[i] cores during the i-th interval sampled."""
    from peers import quiet

    moments = iter(range(10 ** 6))
    used = iter(others_cores)
    clock = {"others": 0.0}

    def fake_sample():
        second = next(moments)
        if second % 2:   # the end of an interval: others used its share of that second
            clock["others"] += next(used)
        return quiet.Sample(float(second), clock["others"])

    monkeypatch.setattr(quiet, "sample", fake_sample)
    monkeypatch.setattr(quiet.time, "sleep", lambda seconds: None)


def test_a_disturbed_run_is_redone_after_a_quiet_moment(monkeypatch):
    from peers.quiet import Guard

    # Attempt 1 disturbed (1 core), a busy then a quiet wait, attempt 2 clean.
    scripted_load(monkeypatch, [1.0, 0.5, 0.0, 0.05])
    guard = Guard(attempts=3)
    results = iter(["first", "second"])
    assert guard.run(lambda: next(results), lambda line: None) == ("second", pytest.approx(0.05))
    assert (guard.disturbed, guard.kept_disturbed) == (1, 0)


def test_when_every_attempt_is_disturbed_the_least_disturbed_is_kept(monkeypatch):
    from peers.quiet import Guard

    scripted_load(monkeypatch, [0.9, 0.0, 0.4, 0.0, 0.7])   # attempts at 0.9, 0.4, 0.7; quiet waits between
    guard = Guard(attempts=3)
    results = iter(["a", "b", "c"])
    assert guard.run(lambda: next(results), lambda line: None) == ("b", pytest.approx(0.4))
    assert (guard.disturbed, guard.kept_disturbed) == (3, 1)


@pytest.mark.slow
def test_quick_run_has_both_systems_on_every_workload(tmp_path, capsys):
    import llama_cpp_cpu

    threads_before = torch.get_num_threads()
    out = tmp_path / "run.json"
    # One thread each: a smoke run on a shared 2-core machine stays quick whatever else runs.
    returned = llama_cpp_cpu.main(["--quick", "--dtypes", "float32", "--engine-threads", "1", "--llama-weights", "q4_1",
                                   "--llama-threads", "1", "--llama-flash-attn", "off", "--llama-kv", "f16",
                                   "--repeats", "1", "--workloads", "prefill", "fork", "fanout", "tot", "best16",
                                   "--json", str(out)])   # MCTS and tree_of_thought_deep: CI time (the same calls)
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload == json.loads(json.dumps(returned, default=str))
    assert printed.rstrip().splitlines()[-1].startswith("llama_cpp_cpu wall time: ")
    summary, detail = payload["tables"]
    labels = [row["workload"] for row in summary["rows"]]
    assert labels == ["prefill", "fork, 32-token branch (per fork)", "prune, 32-token branch (per prune)",
                      "fork, 64-token branch (per fork)", "prune, 64-token branch (per prune)",
                      "fan-out 2: all 4 tokens", "fan-out 2: first tokens", "tree of thought", "best-of-4"]
    for row in summary["rows"]:
        assert row["engine_variant"] == "float32, 1 thread" and row["llama_variant"] == "q4_1, 1 thread, FA off, KV f16"
        assert row["engine_runs"] == [row["engine_s"]] and row["llama_runs"] == [row["llama_s"]]
        assert row["engine_cpu_s"] > 0 and math.isclose(row["cpu_ratio"], row["engine_cpu_s"] / row["llama_cpu_s"])
        assert math.isclose(row["ratio"], row["engine_s"] / row["llama_s"])
        assert (row["engine_floor_s"] is None) == row["workload"].startswith(("fork", "prune"))
        if row["engine_floor_s"] is not None:   # the engine reads float32 weights, llama.cpp the file's blocks
            assert row["engine_floor_s"] >= row["llama_floor_s"] > 0
    assert all(r["others"] >= 0 for r in detail["rows"])
    assert any(line.startswith("other load: ") for line in payload["notes"])
    assert {r["variant"] for r in detail["rows"]} == {"engine float32, 1 thread",
                                                      "llama.cpp q4_1, 1 thread, FA off, KV f16"}
    assert torch.get_num_threads() == threads_before   # the engine's variants set torch's threads; the run restores
    sanity = [line for line in payload["notes"] if line.startswith("sanity: ")]
    assert len(sanity) == 3 and "the same ids" in sanity[0] and "greedy, 16 tokens" in sanity[2]
