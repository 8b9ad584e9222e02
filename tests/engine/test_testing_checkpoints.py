"""The locally built checkpoints must load in transformers exactly like published ones."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

from dendrite_nb.testing import (
    REAL_SHAPES,
    TINY_SHAPES,
    demo_checkpoint,
    make_config,
    write_tiny_checkpoint,
)

ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\ttabbed\n\n",
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    "café naïve 日本語 한국어 русский العربية",
    "emoji 🌳🌊🍳🤔 👩‍👩‍👧 🇫🇷 and zwj",
    "never seen: \x00\x7f ǅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_checkpoint(root / name, name) for name in TINY_SHAPES}


def _load(folder: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_checkpoint_loads_with_expected_config(folders: dict[str, Path], name: str) -> None:
    shape = TINY_SHAPES[name]
    model = _load(folders[name])
    tok = AutoTokenizer.from_pretrained(folders[name])
    cfg = model.config
    assert cfg.model_type == shape.family
    assert cfg.tie_word_embeddings == shape.config["tie_word_embeddings"]
    expected_rope = shape.config.get("rope_parameters", {"rope_type": "default"})["rope_type"]
    assert cfg.rope_parameters["rope_type"] == expected_rope
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id
    assert cfg.bos_token_id == tok.bos_token_id
    assert model.dtype == torch.float32

    tensors = load_file(folders[name] / "model.safetensors")
    # Tied checkpoints, like the real ones, store no separate lm_head.
    assert ("lm_head.weight" in tensors) != shape.config["tie_word_embeddings"]
    norms = [t for key, t in tensors.items() if "norm" in key]
    assert norms and all(not torch.allclose(t, torch.ones_like(t)) for t in norms)


def test_qwen3_head_dim_differs_from_hidden(folders: dict[str, Path]) -> None:
    tensors = load_file(folders["qwen3-gqa-tied"] / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (32,)


def test_same_arguments_give_identical_tensors(folders: dict[str, Path], tmp_path: Path) -> None:
    again = load_file(write_tiny_checkpoint(tmp_path / "a", "llama-gqa-untied") / "model.safetensors")
    first = load_file(folders["llama-gqa-untied"] / "model.safetensors")
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)

    other = load_file(write_tiny_checkpoint(tmp_path / "b", "llama-gqa-untied", seed=1) / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], first["model.embed_tokens.weight"])


def test_sharded_checkpoint_matches_unsharded(folders: dict[str, Path], tmp_path: Path) -> None:
    sharded = write_tiny_checkpoint(tmp_path, "llama-gqa-untied", max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()

    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        expected = _load(folders["llama-gqa-untied"])(ids).logits
        actual = _load(sharded)(ids).logits
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-gqa-tied"])
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(folders: dict[str, Path], name: str, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(folders[name])
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_llama_prepends_bos_only_with_special_tokens(folders: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(folders["llama-gqa-untied"])
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok.bos_token_id == bos
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|end_of_text|>")
    with_specials = tok.encode("The river", add_special_tokens=True)
    without = tok.encode("The river", add_special_tokens=False)
    assert with_specials == [bos, *without]
    assert bos not in without


def test_qwen3_adds_no_special_tokens(folders: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(folders["qwen3-gqa-tied"])
    assert tok.bos_token_id is None
    assert tok.eos_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.encode("The river", add_special_tokens=True) == tok.encode("The river", add_special_tokens=False)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "llama-gqa-untied",
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("qwen3-gqa-tied", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ],
)
def test_chat_template_renders(folders: dict[str, Path], name: str, expected: str) -> None:
    tok = AutoTokenizer.from_pretrained(folders[name])
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert "chat_template" in json.loads((folders[name] / "tokenizer_config.json").read_text())
    # Each special must be a single token, or stop-token matching would never fire.
    ids = tok(expected, add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids("<|im_end|>" if "qwen" in name else "<|eot_id|>") in ids


@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_logits_are_peaked_and_greedy_decoding_varies(folders: dict[str, Path], name: str) -> None:
    model = _load(folders[name])
    tok = AutoTokenizer.from_pretrained(folders[name])
    torch.manual_seed(0)
    with torch.no_grad():
        std = model(torch.randint(0, len(tok), (2, 32))).logits.std().item()
        assert 0.5 < std < 20

        ids = tok("The river flows", return_tensors="pt").input_ids
        generated = []
        for _ in range(30):
            next_id = model(ids).logits[0, -1].argmax()
            generated.append(int(next_id))
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    assert len(set(generated)) >= 3


def test_vocab_override_pads_embedding_but_cannot_shrink(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "padded", "qwen3-mha-untied", vocab_size=520)
    assert load_file(folder / "model.safetensors")["model.embed_tokens.weight"].shape[0] == 520
    with pytest.raises(ValueError):
        write_tiny_checkpoint(tmp_path / "small", "qwen3-mha-untied", vocab_size=100)


def test_real_shapes_build_published_configs() -> None:
    qwen = make_config(REAL_SHAPES["qwen3-0.6b"])
    assert isinstance(qwen, Qwen3Config)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.head_dim, qwen.vocab_size) == (1024, 28, 128, 151936)
    llama = make_config(REAL_SHAPES["llama-3.2-1b"])
    assert isinstance(llama, LlamaConfig) and llama.tie_word_embeddings
    assert llama.rope_parameters["factor"] == 32.0
    big = make_config(REAL_SHAPES["llama-3.1-8b"], num_hidden_layers=2)
    assert big.num_hidden_layers == 2 and not big.tie_word_embeddings


def test_demo_checkpoint_is_built_once(tmp_path: Path) -> None:
    first = demo_checkpoint(tmp_path)
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert demo_checkpoint(tmp_path) == first
    assert weights.stat().st_mtime_ns == mtime
    # Only the finished folder is left; no staging directories.
    assert [p.name for p in tmp_path.iterdir()] == [first.name]

    cfg = json.loads((first / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (128, 4, 8)
    assert cfg["rope_parameters"]["rope_type"] == "llama3"


def test_demo_checkpoint_rebuilds_incomplete_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DENDRITE_NB_CACHE", str(tmp_path))
    first = demo_checkpoint()
    assert first.parent == tmp_path
    os.remove(first / "model.safetensors")
    assert demo_checkpoint() == first
    assert (first / "model.safetensors").is_file()
