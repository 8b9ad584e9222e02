"""benchmarks/llama_cpp_gpu.py and its GGUF of the engine's random model (benchmarks/peers/random_gguf.py): the file
holds the engine's very tensors (read back by the engine's own GGUF reader), llama.cpp (the CPU wheel) computes the
engine's logits from it on the same ids (float32, a Qwen3 shape and a Llama one whose q/k rows llama.cpp wants
permuted), and the whole script's --smoke run has both systems on its workloads (no timing is checked). The llama.cpp
tests are skipped, saying so, where llama-cpp-python is not installed."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("benchmarks_on_path")


def tiny_model(shape: str):
    from bench_common import SMOKE_VOCAB, Setup, build_model

    from dendrite_nb.testing import TINY_SHAPES

    setup = Setup(torch.device("cpu"), torch.float32, smoke=True)
    return build_model(setup, TINY_SHAPES[shape].hf_config(**SMOKE_VOCAB), seed=3)


@pytest.mark.parametrize("shape", ["qwen3-gqa-tied", "llama-gqa-untied"])
def test_the_gguf_holds_the_engines_tensors_and_shape(tmp_path, shape):
    from peers.random_gguf import write_random_gguf

    from dendrite_nb.model.gguf import load_weights, open_gguf
    from dendrite_nb.model.rope import rope_inv_freq

    model = tiny_model(shape)
    checkpoint = open_gguf(write_random_gguf(model, tmp_path / "m.gguf", "f32"))
    # GGUF stores eps as float32, and Llama 3's scaling as each frequency's divisor: compare what they compute.
    read, written = checkpoint.config, model.config
    assert dataclasses.replace(read, rms_norm_eps=written.rms_norm_eps, rope_factors=None,
                               rope_scaling=written.rope_scaling) == written
    assert read.rms_norm_eps == pytest.approx(written.rms_norm_eps)
    torch.testing.assert_close(rope_inv_freq(read, "cpu"), rope_inv_freq(written, "cpu"))
    # The engine's reader undoes llama.cpp's q/k permutation and its tied table: it must get every tensor back.
    loaded = load_weights(checkpoint, torch.device("cpu"), torch.float32)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name
    tokens = checkpoint.reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == model.config.vocab_size and tokens.contents()[7] == "<t7>"


def test_16_bit_copies_round_to_the_model_and_bad_requests_are_refused(tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from peers.random_gguf import RandomGGUFError, write_random_gguf

    model = tiny_model("qwen3-gqa-tied")
    weight = model.model.layers[0].mlp.down_proj.weight
    for kind, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        reader = GGUFReader(write_random_gguf(model, tmp_path / f"{kind}.gguf", kind))
        stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
        np.testing.assert_array_equal(dequantize(stored.data, stored.tensor_type),
                                      weight.detach().to(dtype).float().numpy())
    with pytest.raises(RandomGGUFError, match="q4_0"):
        write_random_gguf(model, tmp_path / "x.gguf", "q4_0")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("shape", ["qwen3-gqa-tied", "llama-gqa-untied"])
def test_llama_cpp_computes_the_engines_logits_from_the_gguf(tmp_path, shape):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
    from bench_common import random_ids
    from peers.llama_cpp_peer import LlamaCppModel, LlamaCppPeer, LlamaSetting
    from peers.random_gguf import write_random_gguf
    from peers.systems import GREEDY

    from dendrite_nb import Engine

    model = tiny_model(shape)
    path = write_random_gguf(model, tmp_path / "m.gguf", "f32")
    engine = Engine(model, None, device="cpu", attention="torch")
    ids = random_ids(40, model.config.vocab_size, seed=5)
    branch = engine.new_branch("a", ids)
    ours = engine.next_logits([branch])[0].numpy()
    (ours_tokens,) = engine.generate([branch], 8, GREEDY)
    peer = LlamaCppPeer(LlamaCppModel(path), LlamaSetting(1, False, "f32"), n_ctx=256, n_seq_max=1)
    sequence = peer.new_sequence()
    peer.feed([(sequence, ids)])
    theirs = peer.logits(len(ids) - 1).copy()
    (theirs_tokens,) = peer.generate([sequence], 8)
    peer.close()
    np.testing.assert_allclose(theirs, ours, atol=1e-4 * np.abs(ours).max())
    assert theirs_tokens == ours_tokens


def test_smoke_run_has_both_systems_and_the_engine_alone_past_llama_cpps_sequences(tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
    import llama_cpp_gpu

    out = tmp_path / "run.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # on a shared 2-core machine, two torch threads wait on each other at every product
    try:
        returned = llama_cpp_gpu.main(["--smoke", "--workloads", "fork-step", "best16", "--repeats", "1",
                                       "--llama-flash-attn", "on", "--llama-threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload == json.loads(json.dumps(returned, default=str))
    assert printed.rstrip().splitlines()[-1].startswith("llama_cpp_gpu wall time: ")
    summary, detail = payload["tables"]
    rows = {row["workload"]: row for row in summary["rows"]}
    assert list(rows) == ["first step, 260 leaves, 64-token prefix", "fork x260 (one call), 64-token branch",
                          "first step, 6 leaves, 64-token prefix", "fork x6 (one call), 64-token branch", "best-of-4"]
    for label in list(rows)[:2]:   # more sequences than llama.cpp holds: the engine alone, saying why
        assert rows[label]["llama_variant"].startswith("unavailable: llama.cpp holds at most 256 sequence ids")
        assert "llama_s" not in rows[label] and rows[label]["engine_s"] > 0
    for label in list(rows)[2:]:
        row = rows[label]
        assert math.isclose(row["ratio"], row["engine_s"] / row["llama_s"])
        assert row["tokens"] == "same"   # float32 on both: the same greedy tokens
        assert (row["floor_s"] is None) == label.startswith("fork")
    assert rows["first step, 260 leaves, 64-token prefix"]["floor_s"] > rows["first step, 6 leaves, 64-token prefix"][
        "floor_s"] > 0
    # The backend sampler passed its probe and was one of the settings searched.
    assert any(line.startswith("llama.cpp's backend sampler") and "equal the host's" in line
               for line in payload["notes"])
    assert any(r["variant"].endswith("greedy in the graph") for r in detail["rows"])
    sanity = [line for line in payload["notes"] if line.startswith("sanity: ")]
    assert "argmax the same" in sanity[0] and all("equal to the engine's" in line for line in sanity[1:])
