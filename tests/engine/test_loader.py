"""Loading checkpoints: sharded equals single-file, transformers 4.x config spelling, tied heads, chat template,
Qwen2's biases and Mistral's sliding window."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dendrite_nb import CheckpointError, ContextOverflow, Engine
from dendrite_nb.model.config import ModelConfig
from dendrite_nb.testing import write_tiny_checkpoint

PROMPT = "Sharded or not, the same numbers"


def logits_of(folder):
    eng = Engine.from_pretrained(folder, num_blocks=32)
    return eng.next_logits([eng.new_branch("a", PROMPT)])


def test_sharded_checkpoint_loads_identically(checkpoint, tmp_path):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", max_shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(logits_of(sharded), logits_of(checkpoint()))


def test_transformers4_config_spelling_is_read(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint(), tmp_path / "legacy")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope  # {"rope_type": "llama3", "factor": ..., ...} as 4.x checkpoints carry it
    (folder / "config.json").write_text(json.dumps(config))
    assert torch.equal(logits_of(folder), logits_of(checkpoint()))


def test_tied_checkpoint_may_carry_its_lm_head(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("qwen3-gqa-tied"), tmp_path / "tied")
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    assert torch.equal(logits_of(folder), logits_of(checkpoint("qwen3-gqa-tied")))


def test_generation_config_adds_end_tokens(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint(), tmp_path / "instruct")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    eng = Engine.from_pretrained(folder, num_blocks=8)
    assert {5, 6} <= eng.eos_token_ids and eng.tokenizer.eos_token_id in eng.eos_token_ids


def test_chat_template_and_bos(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=32)
    text = eng.format_chat([{"role": "user", "content": "hi"}])
    assert "hi" in text and "<|start_header_id|>" in text
    branch = eng.new_branch("chat", text)
    assert branch.tokens[0] == eng.tokenizer.bos_token_id
    eng.append(branch, "more")
    assert branch.tokens.count(eng.tokenizer.bos_token_id) == 1  # appends add no BOS


def test_random_real_shape_engine_runs_on_token_ids():
    config = {"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 256, "tie_word_embeddings": True}
    eng = Engine.from_random(config, num_blocks=16)
    branch = eng.new_branch("ids", [1, 2, 3, 4, 5])
    assert len(eng.generate([branch], 4)[0]) == 4
    assert eng.next_logits([branch]).shape == (1, 1000)


def test_real_shapes_parse_with_their_published_numbers():
    from dendrite_nb.model.config import ModelConfig
    from dendrite_nb.testing import REAL_SHAPES

    eight_b = ModelConfig.from_hf(REAL_SHAPES["llama-3.1-8b"].hf_config())
    assert (eight_b.num_layers, eight_b.num_kv_heads, eight_b.head_dim, eight_b.vocab_size) == (32, 8, 128, 128256)
    assert eight_b.rope_scaling["factor"] == 8.0 and not eight_b.tie_word_embeddings
    qwen = ModelConfig.from_hf(REAL_SHAPES["qwen3-0.6b"].hf_config())
    assert qwen.qk_norm and qwen.tie_word_embeddings and qwen.head_dim * qwen.num_heads != qwen.hidden_size
    small = Engine.from_random(REAL_SHAPES["llama-3.2-1b"].hf_config(num_hidden_layers=1, vocab_size=512,
                                                                      intermediate_size=256), num_blocks=8)
    assert len(small.generate([small.new_branch("x", [1, 2, 3])], 2)[0]) == 2


def test_qwen2_biases_q_k_and_v_but_not_o_and_llama_biases_all_four():
    from dendrite_nb.testing import TINY_SHAPES

    qwen2 = ModelConfig.from_hf(TINY_SHAPES["qwen2-gqa-tied"].hf_config(vocab_size=512))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.sliding_window) == (True, False, None)  # its window is off
    llama = ModelConfig.from_hf(TINY_SHAPES["llama-biased"].hf_config(vocab_size=512))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    # Phi-3-mini-4k's window applies to every layer, as Mistral's does; Qwen2's is off without use_sliding_window.
    phi3 = ModelConfig.from_hf(TINY_SHAPES["phi3-gqa-untied"].hf_config(
        vocab_size=512, max_position_embeddings=4096, sliding_window=2047))
    assert (phi3.max_position_embeddings, phi3.sliding_window) == (2047, 2047)


def test_phi3_fused_tensors_on_disk_fill_the_separate_projections(checkpoint):
    from safetensors import safe_open

    folder = checkpoint("phi3-gqa-untied")
    eng = Engine.from_pretrained(folder, num_blocks=8)
    attention, mlp = eng.model.model.layers[0].self_attn, eng.model.model.layers[0].mlp
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        qkv = f.get_tensor("model.layers.0.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.0.mlp.gate_up_proj.weight")
    assert torch.equal(torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]), qkv)
    assert torch.equal(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up)
    assert attention.k_proj.weight.shape[0] < attention.q_proj.weight.shape[0]  # GQA: the split is not even


def test_a_mistral_window_shorter_than_its_positions_caps_the_context(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("mistral-gqa-untied"), tmp_path / "windowed")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 24}))
    eng = Engine.from_pretrained(folder, num_blocks=32)
    assert eng.config.max_position_embeddings == eng.config.sliding_window == 24
    branch = eng.new_branch("a", PROMPT)
    # Inside the window the whole-context attention is exactly the model's: same logits as without a window.
    full = Engine.from_pretrained(checkpoint("mistral-gqa-untied"), num_blocks=32)
    assert torch.equal(eng.next_logits([branch]), full.next_logits([full.new_branch("a", PROMPT)]))
    before = eng.tree(), eng.num_free_blocks
    with pytest.raises(ContextOverflow, match="the model allows 24 \\(its sliding window"):
        eng.generate([branch], 24)
    assert (eng.tree(), eng.num_free_blocks) == before


def test_a_big_checkpoint_shows_a_progress_bar_and_a_small_one_loads_silently(checkpoint, monkeypatch, capfd):
    import dendrite_nb.model.loader as loader

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    logits_of(checkpoint())
    assert "loading" not in capfd.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)  # the tiny checkpoint now counts as big
    logits_of(checkpoint())
    err = capfd.readouterr().err
    assert f"loading {checkpoint().name}" in err and "tensors" in err, err


@pytest.mark.parametrize("edit,field", [
    (lambda raw: raw.pop("hidden_size"), "no hidden_size"),
    (lambda raw: raw.update(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (lambda raw: raw.update(vocab_size="many"), "vocab_size must be a positive integer, got 'many'"),
    (lambda raw: raw.update(num_key_value_heads=2.5), "num_key_value_heads must be a positive integer"),
    (lambda raw: raw.update(head_dim=None, num_attention_heads=3), r"num_attention_heads \(3\) does not divide"),
    (None, "is not valid JSON"),
])
def test_a_damaged_config_is_a_checkpoint_error_naming_the_file_and_field(checkpoint, tmp_path, monkeypatch,
                                                                          edit, field):
    """Found by a QA pass: a missing size was a bare KeyError, heads of 0 a ZeroDivisionError, a word for a size
    transformers' validator, broken JSON a message without the file. Refused before a weight loads."""
    folder = tmp_path / "damaged"
    shutil.copytree(checkpoint(), folder)
    raw = json.loads((folder / "config.json").read_text())
    if edit is None:
        (folder / "config.json").write_text(json.dumps(raw)[:-5])
    else:
        edit(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    monkeypatch.setattr("dendrite_nb.engine.build.load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    for call in (Engine.check_pretrained, Engine.from_pretrained):
        with pytest.raises(CheckpointError, match=field) as raised:
            call(folder)
        assert str(folder / "config.json") in str(raised.value)


@pytest.mark.parametrize("config", ["llama", {"model_type": "llama", "hidden_size": 64}])
def test_from_random_refuses_a_config_that_is_not_one(config):
    with pytest.raises(CheckpointError, match="a dict|no vocab_size"):
        Engine.from_random(config)
    with pytest.raises(CheckpointError, match="a dict|no vocab_size"):
        Engine.check_random(config)


@pytest.mark.parametrize("options,message", [
    ({"attention": "flash"}, "'flash' is not available"),
    ({"attention": "flashinfer"}, "cannot run on cpu"),
    ({"cuda_graphs": True}, "cuda_graphs=True, but they need a CUDA device"),
])
def test_options_the_engine_would_refuse_are_refused_before_the_weights_load(checkpoint, monkeypatch, options,
                                                                              message):
    """check_pretrained said yes to these, and from_pretrained loaded every weight before refusing them."""
    monkeypatch.setattr("dendrite_nb.engine.build.load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    for call in (Engine.check_pretrained, Engine.from_pretrained):
        with pytest.raises(ValueError, match=message):
            call(checkpoint(), **options)
