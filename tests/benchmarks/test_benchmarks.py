"""The GPU fast-path benchmarks, run with --smoke (tiny shapes, CPU, torch attention), so that they keep
working between GPU runs: each prints its closing table and wall time, writes the same as JSON, and its
figures are consistent (every time next to a positive floor, ratios computed from them)."""
from __future__ import annotations

import gc
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

from dendrite_nb.kv.cascade import MIN_SHARED_TOKENS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """run(script, *args) -> (JSON payload, printed output) of the script's main with --smoke on the CPU."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))   # the scripts import bench_common from beside them

    def run_script(script: str, *extra: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{script}", BENCHMARKS / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)   # dataclasses look their module up while defining
        spec.loader.exec_module(module)
        out = tmp_path / f"{script}.json"
        returned = module.main(["--smoke", "--device", "cpu", "--json", str(out), *extra])
        printed = capsys.readouterr().out
        payload = json.loads(out.read_text())
        assert payload == json.loads(json.dumps(returned, default=str))
        last_lines = printed.rstrip().splitlines()
        assert last_lines[-1].startswith(f"{script} wall time: ")
        for table in payload["tables"]:
            assert table["title"] in printed   # the closing table is printed, not only written
        matmul = payload["floors"]["matmul_flop_per_s"]   # None where nothing is computed (an all-reduce)
        assert payload["floors"]["copy_bytes_per_s"] > 0 and (matmul is None or matmul > 0)
        return payload, printed

    return run_script


def rows(payload, table: int = 0) -> list[dict]:
    return payload["tables"][table]["rows"]


def measured(row: dict) -> bool:
    return "unavailable" not in row


def test_decode_step(run):
    payload, printed = run("decode_step")
    table = rows(payload)
    for case in ("(a)", "(b)"):
        case_rows = [r for r in table if r["case"].startswith(case)]
        torch_row = next(r for r in case_rows if r["attention"] == "torch")
        hf_row = next(r for r in case_rows if r["attention"] == "transformers")
        for row in (torch_row, hf_row):
            assert row["step_ms"] > 0 and row["floor_ms"] > 0
            assert math.isclose(row["x_floor"], row["step_ms"] / row["floor_ms"], rel_tol=1e-9)
        assert math.isclose(torch_row["vs_hf"], hf_row["step_ms"] / torch_row["step_ms"], rel_tol=1e-9)
        # The fast backends are not run on the CPU; their rows say why instead of failing the run.
        skipped = [r for r in case_rows if r["attention"] in ("triton", "flashinfer")]
        assert len(skipped) == 4 and all(r["unavailable"] for r in skipped)
    assert "unavailable: " in printed
    assert [line for line in payload["notes"] if line.startswith("(a) float32 best: torch")]


def test_decode_step_with_quantized_weights(run):
    payload, _ = run("decode_step", "--cases", "b", "--no-hf", "--weights", "int8")
    torch_rows = {r["weights"]: r for r in rows(payload) if r["attention"] == "torch"}
    assert set(torch_rows) == {"float32", "int8"} and all(r["step_ms"] > 0 for r in torch_rows.values())
    # int8 weights are a quarter of float32's bytes (plus scales): never a higher floor for the same step. Equal
    # floors happen: a floor is the larger of the bytes' time and the FLOPs' time, and on a loaded CI machine the
    # matmul rate measured for the tiny shapes can make the FLOPs' time, the same for both, the larger.
    assert torch_rows["int8"]["floor_ms"] <= torch_rows["float32"]["floor_ms"]
    assert [line for line in payload["notes"] if line.startswith("(b) int8 best: torch")]


def test_decode_step_with_logprobs(run):
    payload, _ = run("decode_step", "--cases", "b", "--no-hf", "--logprobs")
    assert "logprobs=True" in payload["tables"][0]["title"]
    torch_row = next(r for r in rows(payload) if r["attention"] == "torch")
    assert torch_row["step_ms"] > 0


def test_tree_attention(run):
    payload, _ = run("tree_attention")
    table = rows(payload)
    reference = {r["scenario"]: r for r in table if r["method"] == "torch reference"}
    assert set(reference) == {"(i)", "(ii)", "(iii)"}
    # Distinct tokens a tree-aware read loads (smoke shapes): prefix + every node's own tokens, once.
    assert reference["(i)"]["unique_tokens"] == 128 + 8 * 1
    assert reference["(ii)"]["unique_tokens"] == 128 + 2 * 64 + 6 * 8
    assert reference["(iii)"]["unique_tokens"] == 64 + 8 * 1
    assert reference["(ii)"]["context_tokens"] == 6 * (128 + 64 + 8)
    # The tree layout reads the prefix once for all rows, and in (ii) each child's 64 tokens once for its 3
    # grandchildren when nodes that short are shared at all.
    assert reference["(i)"]["shared_segments"] == 1
    assert reference["(ii)"]["shared_segments"] == 1 + (2 if 64 >= MIN_SHARED_TOKENS else 0)
    for row in reference.values():
        assert row["us"] > 0 and row["floor_us"] > 0 and row["rel_err"] == 0.0
    assert any("PASS" in line for line in payload["notes"])


def test_fork_decode(run):
    payload, _ = run("fork_decode")
    table = {r["what"].strip(): r for r in rows(payload)}
    assert table["fork x20 (one call)"]["ms"] > 0 and table["fork x20, back to back"]["ms"] > 0
    first = table["first step, 20 leaves"]
    assert first["ms"] > 0 and first["floor_ms"] > 0
    blocks = table["blocks in use"]
    # 64-token prefix = 4 blocks, and each of the 20 leaves' 16 tokens fills exactly one block of its own.
    assert blocks["blocks_in_use"] == blocks["expected_blocks"] == 4 + 20
    assert "PASS" in next(line for line in payload["notes"] if line.startswith("blocks after"))


def test_cpu_sampling(run):
    """Each row count has the engine's draw and its two peers, each next to a positive floor."""
    payload, _ = run("cpu_sampling")
    table = rows(payload)
    assert {(r["rows"], r["variant"]) for r in table} == {(str(n), v) for n in (1, 4)
                                                         for v in ("engine", "race, exponential_", "multinomial")}
    for row in table:
        assert row["ms"] > 0 and row["floor_ms"] > 0
        assert math.isclose(row["ms_per_row"] * int(row["rows"]), row["ms"])
        if row["variant"] == "engine":
            assert row["vs_engine"] == 1.0


def test_tree_of_thought(run):
    payload, printed = run("tree_of_thought", "--shapes", "qwen3-0.6b")
    systems = {r["system"]: r for r in rows(payload)}
    assert len(systems) == 4   # the engine's first and repeated searches, and the two transformers peers
    engines = [r for name, r in systems.items() if name.startswith("engine")]
    assert [r["system"].rsplit(", ", 1)[1] for r in engines] == ["first search", "repeated (best of 3)"]
    for row in systems.values():
        assert row["s"] > 0 and row["floor_s"] > 0
        if row not in engines:   # peers are compared with the repeated searches' best, the one judged
            assert math.isclose(row["speedup"], row["s"] / engines[1]["s"], rel_tol=1e-9)
    # Judged: the fastest of the 3 repeated searches and of the 3 runs of peer (b), every run printed.
    for prefix, system in (("repeated ", engines[1]["system"]),
                           ("DynamicCache deep copy: ", next(name for name in systems if name.startswith("(b)")))):
        line = next(line for line in printed.splitlines() if prefix in line)
        times = [float(t) for t in line.split(prefix)[1].removesuffix(" s").split(", ")]
        assert len(times) == 3 and math.isclose(systems[system]["s"], min(times), abs_tol=1e-3)
    assert "same argmax: True" in printed   # the transformers peer holds the engine's weights


def test_fanout(run):
    payload, _ = run("fanout")
    table = rows(payload)
    assert [r["n"] for r in table] == [2, 5]
    for row in table:
        assert row["fork_ms"] > 0 and row["reprefill_ms"] > 0 and row["hf_ms"] > 0
        assert row["fork_floor_ms"] < row["reprefill_floor_ms"]   # forking skips the document's prefill
        assert math.isclose(row["ratio"], row["reprefill_ms"] / row["fork_ms"], rel_tol=1e-9)
    assert "SwarmKV" in payload["notes"][0]


def test_prefill_chunks(run):
    payload, _ = run("prefill_chunks")
    table = rows(payload)
    assert [(r["tokens"], r["chunk"]) for r in table] == [(96, 16), (96, 64)]
    assert table[0]["floor_ms"] == table[1]["floor_ms"] > 0   # the document's floor, whatever its chunks
    for row in table:
        assert math.isclose(row["x_floor"], row["ms"] / row["floor_ms"], rel_tol=1e-9)
        assert math.isclose(row["hf_ratio"], row["hf_ms"] / row["ms"], rel_tol=1e-9)


def test_gpu_diagnostics_name_what_exists(monkeypatch):
    """profile_step.py, tune_skinny.py, eager_products.py and tune_one_tile.py run on a GPU only, and
    tune_tree_attention.py's real sweeps too (its smoke run is the next test); here, every function they time and
    every attention variant they build must still exist, so a rename breaks this test, not the GPU run. (The lab's
    probes in docs/lab/probes/ are not kept in step with the engine: docs/lab/probes/README.md.)"""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    pytest.importorskip("triton")
    profile_step = importlib.import_module("profile_step")
    tune = importlib.import_module("tune_tree_attention")
    from dendrite_nb.attention.triton_backend import TritonAttention

    for owner, name, _ in profile_step.HOST_PHASES:
        assert callable(getattr(owner, name)), f"{owner.__name__}.{name}"
    for _, options in profile_step.ATTENTION_VARIANTS + tune.VARIANTS:
        TritonAttention(**options)
    with pytest.raises(SystemExit, match="GPU"):
        profile_step.main(["--smoke", "--device", "cpu"])
    with pytest.raises(SystemExit, match="GPU"):
        importlib.import_module("tune_skinny").main(["--smoke", "--device", "cpu"])
    with pytest.raises(SystemExit, match="GPU"):
        importlib.import_module("eager_products").main(["--smoke", "--device", "cpu"])
    # tune_one_tile.py and decode_step.py set these on an engine's backend to pick a launch or the general path.
    backend = TritonAttention()
    assert backend.one_tile_programs_per_sm > 0 and backend.one_tile_launch is None  # tune_one_tile sets a pair
    from dendrite_nb.cuda_graphs import ForwardGraphs

    assert "_graphs" in ForwardGraphs.__init__.__code__.co_names  # tune_one_tile.py replays the last graph
    with pytest.raises(SystemExit, match="GPU"):
        importlib.import_module("tune_one_tile").main(["--smoke", "--device", "cpu"])


def test_attention_tuner_times_each_launch_and_the_merge_alone(monkeypatch, capsys):
    """tune_tree_attention.py --launches: under each variant's line, a scenario's launches one by one (tile width,
    items, time, compiled resources) and its merge (slots, time); every time positive. With --tensor-parallel 2, on
    the heads one rank of two holds."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("the tuner's CPU run needs TRITON_INTERPRET=1 (the test session's default)")
    tune = importlib.import_module("tune_tree_attention")
    whole = tune.make_setup(tune.parser("").parse_args(["--smoke"])).hf_config("llama-3.1-8b")
    tune.main(["--smoke", "--device", "cpu", "--only", "default", "--launches", "--tensor-parallel", "2"])
    heads, header, variant, dissection = capsys.readouterr().out.strip().splitlines()
    assert heads == (f"one layer, {whole['num_attention_heads'] // 2}q/{whole['num_key_value_heads'] // 2}kv heads "
                     f"x{whole['hidden_size'] // whole['num_attention_heads']}")
    assert header.split() == ["variant", "(a)", "us"] and variant.split()[0] == "default"
    assert float(variant.split()[1]) > 0
    launches, merge = dissection.strip().split(" | ")[:-1], dissection.split(" | ")[-1]
    launch = r"(\(a\) )?\d+-wide( short)?( tma)? x\d+ <=\d+: [\d.]+ us \[interpreted\]"
    assert launches and all(re.fullmatch(launch, part) for part in launches), dissection
    assert re.fullmatch(r"merge \(\d+ slots\): [\d.]+ us", merge), dissection
    assert all(float(number) > 0 for number in re.findall(r"([\d.]+) us", dissection))


def test_host_step_times_each_leaf_count_with_the_collector_on_and_the_heap_frozen(monkeypatch, capsys):
    """host_step.py stubs the model out and times the engine's own work per step: a row per leaf count and GC
    setting, every time positive."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    pytest.importorskip("triton")
    importlib.import_module("host_step").main(["--smoke", "--leaves", "1", "4"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(line[0], " ".join(line[1:3])) for line in lines] == [
        ("1", "collector on"), ("1", "heap frozen"), ("4", "collector on"), ("4", "heap frozen")]
    assert all(float(line[3]) > 0 and float(line[4]) > 0 and float(line[-1]) > 0 for line in lines)
    assert gc.get_freeze_count() == 0  # the heap is given back to the collector


def test_cpu_decode(run):
    """Each leaf count has the four engine variants and the transformers peer, each next to a positive floor."""
    payload, _ = run("cpu_decode")
    table = rows(payload)
    variants = {("torch-tree", "W @ x.T"), ("torch", "W @ x.T"), ("torch-tree", "F.linear"), ("torch", "F.linear"),
                ("transformers", "F.linear")}
    assert {(r["leaves"], r["attention"], r["products"]) for r in table} == {(n, *v) for n in ("1", "4")
                                                                          for v in variants}
    for row in table:
        assert row["step_ms"] > 0 and row["floor_ms"] > 0
        assert math.isclose(row["x_floor"], row["step_ms"] / row["floor_ms"])
        peer = next(r for r in table if r["leaves"] == row["leaves"] and r["attention"] == "transformers")
        assert math.isclose(row["vs_hf"], peer["step_ms"] / row["step_ms"])


def test_cpu_decode_in_bfloat16_has_no_w_at_x_rows(run):
    """--dtype bfloat16: W @ x.T acts on float32 only, so each leaf count has torch-tree and torch through F.linear
    and the transformers peer, in bf16 (the table's title and the JSON say so)."""
    payload, printed = run("cpu_decode", "--dtype", "bfloat16")
    assert payload["dtype"] == "bfloat16" and "bfloat16 (median" in printed
    assert {(r["leaves"], r["attention"], r["products"]) for r in rows(payload)} == {
        (n, attention, "F.linear") for n in ("1", "4") for attention in ("torch-tree", "torch", "transformers")}


def test_batch_scaling(run):
    payload, _ = run("batch_scaling")
    by_leaves = {r["leaves"]: r for r in rows(payload)}
    assert set(by_leaves) == {1, 4}
    for row in by_leaves.values():
        assert row["greedy_ms"] > 0 and row["sampled_ms"] > 0 and row["short_ms"] > 0 and row["floor_ms"] > 0
        assert math.isclose(row["x_greedy"], row["sampled_ms"] / row["greedy_ms"], rel_tol=1e-9)
    assert by_leaves[1]["x_one_leaf"] == 1.0
    assert by_leaves[4]["floor_ms"] > by_leaves[1]["floor_ms"]   # four leaves' own KV on top of the same weights
    assert len(payload["notes"]) >= 3


def test_tensor_parallel(run):
    """TP=1 then TP=2 (two gloo processes on the CPU): each row's floor is its share of the same bytes."""
    payload, printed = run("tensor_parallel")
    one, two = rows(payload)
    assert (one["variant"], two["variant"]) == ("TP=1", "TP=2")
    assert one["x_tp1"] == 1.0 and two["step_ms"] > 0
    assert math.isclose(two["floor_ms"], one["floor_ms"] / 2, rel_tol=1e-9)
    assert "TP=2: " in printed and "the TP=1 step" in payload["notes"][0]


def test_all_reduce(run):
    """Two gloo processes on the CPU: the eager row only (graphs and peer memory need GPUs; the row's name is the
    GPU's, "NCCL", for the group's eager all-reduce), its time next to the floor of reading the peer's tensor once,
    and a step's 64 of them."""
    payload, _ = run("all_reduce")
    (row,) = rows(payload)
    assert (row["rows"], row["variant"]) == (4, "NCCL, eager")
    assert row["us"] > 0 and row["floor_us"] > 0
    assert math.isclose(row["x_floor"], row["us"] / row["floor_us"], rel_tol=1e-9)
    assert math.isclose(row["step_ms"], row["us"] * 64 / 1e3, rel_tol=1e-9)


def test_tensor_parallel_tree_of_thought(run):
    """--tree-of-thought: one row, the search by a model split over two gloo processes, its per-step floor a rank's
    share of the bytes."""
    payload, _ = run("tensor_parallel", "--tree-of-thought")
    (row,) = rows(payload)
    assert row["system"] == "engine, TP=2" and row["s"] > 0 and row["floor_ms"] > 0
    assert math.isclose(row["step_ms"], row["s"] / 8 * 1e3, rel_tol=1e-9)   # smoke: depth 2 x 4 tokens
    assert "8 decode steps of 3 leaves" in payload["notes"][0]
