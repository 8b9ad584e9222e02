"""GGUF files: the engine on a GGUF equals the engine on the same weights from safetensors, and transformers on
the same file, for every supported quantization type and family; bad files fail with a named error.

The files are written from the tiny checkpoints by dendrite_nb.testing.gguf_writer (as llama.cpp's converter
writes them). A quantized file is compared with the safetensors of the weights it dequantizes to.
"""
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from dendrite_nb import CheckpointError, Engine, SamplingParams, UnsupportedModel
from dendrite_nb.model import gguf_tokenizer
from dendrite_nb.model.gguf import SUPPORTED_TYPES
from dendrite_nb.testing import write_tiny_checkpoint
from dendrite_nb.testing.gguf_writer import write_gguf
from dendrite_nb.testing.kquants import K_QUANT_TYPES, quantize_k

PROMPT = "Rivers carve their valleys slowly, one grain at a time."
STEPS = 8
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SAME_WEIGHTS = 1e-5  # the engine on the same numbers: only the metadata's float32 epsilon differs
TRANSFORMERS = 1e-4
# Rows of the k-quants are cut in blocks of 256 values, so their model is 256 wide (and its weights half as
# large, for logits of the usual size).
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "initializer_range": 0.2}
# transformers' GGUF reader takes Qwen3's head_dim from Qwen3Config's default (128), not from the file.
QWEN3_HEAD_DIM_128 = {"head_dim": 128}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Tokenizers converted here go to a cache of this module, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DENDRITE_NB_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """gguf_file(shape, qtype, **config) -> (GGUF path, HF folder of the weights it dequantizes to), written once."""
    written = {}

    def get(shape, qtype="F32", end_of_turn=None, **config):
        key = (shape, qtype, end_of_turn, tuple(sorted(config.items())))
        if key not in written:
            root = tmp_path_factory.mktemp(f"{shape}-{qtype}")
            source = write_tiny_checkpoint(root / "hf", shape, **config)
            path = write_gguf(source, root / "gguf" / f"{shape}.{qtype}.gguf", qtype, end_of_turn=end_of_turn,
                              dequantized=root / "dequantized")
            written[key] = path, root / "dequantized"
        return written[key]

    return get


def run(eng):
    """(next-token logits after the prompt and after STEPS greedy steps [2, vocab], the branch's tokens)."""
    branch = eng.new_branch("a", PROMPT)
    first = eng.next_logits([branch])[0]
    eng.generate([branch], STEPS, GREEDY)
    return torch.stack([first, eng.next_logits([branch])[0]]), branch.tokens


def transformers_logits(path, tokens):
    """Teacher-forced logits of transformers on the GGUF file itself [len(tokens), vocab]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def check_against_transformers(path, logits, tokens):
    start = len(tokens) - STEPS
    reference = transformers_logits(path, tokens)
    assert (logits - reference[[start - 1, -1]]).abs().max() < TRANSFORMERS
    assert tokens[start:] == reference[start - 1: -1].argmax(-1).tolist()  # each greedy step is its argmax
    assert len(set(tokens[start:])) > 3  # the random model is not stuck on one token


# ---- the same model as from safetensors -----------------------------------------------------------------
@pytest.mark.parametrize("shape", ["llama-gqa-untied", "llama-mha-tied", "llama-biased", "mistral-gqa-untied",
                                   "qwen2-gqa-tied", "qwen3-gqa-tied", "qwen3-mha-untied", "phi3-gqa-untied"])
def test_f32_gguf_runs_as_its_safetensors_checkpoint(shape, gguf_file):
    """Every family and tiny shape: Llama 3 RoPE scaling (as rope_freqs), tied and untied heads, biases, Qwen3's
    head_dim * heads != hidden (key_length), Phi-3's fused q/k/v and gate/up, Mistral written as llama."""
    path, reference = gguf_file(shape)
    logits, tokens = run(Engine.from_pretrained(path, num_blocks=32))
    expected_logits, expected_tokens = run(Engine.from_pretrained(reference, num_blocks=32))
    assert tokens == expected_tokens
    assert (logits - expected_logits).abs().max() < SAME_WEIGHTS


# ---- every quantization type --------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [t.name for t in SUPPORTED_TYPES])
def test_every_type_equals_its_dequantized_weights_and_transformers(qtype, gguf_file):
    """The engine on a file of this type = the engine on the weights gguf dequantizes it to (safetensors) =
    transformers on the file: logits within 1e-5 and 1e-4 after the prompt and after STEPS greedy steps,
    the same greedy tokens."""
    kind = GGMLQuantizationType[qtype]
    path, reference = gguf_file("llama-mha-tied", qtype, **(WIDE if kind in K_QUANT_TYPES else {}))
    eng = Engine.from_pretrained(path, num_blocks=32)
    logits, tokens = run(eng)
    expected_logits, expected_tokens = run(Engine.from_pretrained(reference, num_blocks=32))
    assert tokens == expected_tokens
    assert (logits - expected_logits).abs().max() < SAME_WEIGHTS
    check_against_transformers(path, logits, tokens)
    assert kind in {t.tensor_type for t in GGUFReader(path).tensors}  # the file really holds this type


@pytest.mark.parametrize("shape, config", [("qwen2-gqa-tied", {}), ("qwen3-gqa-tied", QWEN3_HEAD_DIM_128),
                                           ("phi3-gqa-untied", {}), ("mistral-gqa-untied", {})])
def test_other_families_match_transformers_on_the_same_file(shape, config, gguf_file):
    path, _ = gguf_file(shape, "Q8_0", **config)
    logits, tokens = run(Engine.from_pretrained(path, num_blocks=32))
    check_against_transformers(path, logits, tokens)


def test_bfloat16_engine_dequantizes_into_its_dtype(gguf_file):
    path, _ = gguf_file("llama-mha-tied", "Q8_0")
    eng = Engine.from_pretrained(path, dtype="bfloat16", num_blocks=32)
    assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
    reference, _ = run(Engine.from_pretrained(path, num_blocks=32))
    logits, _ = run(eng)
    # bf16 rounding of weights and activations: within 5% of the largest logit
    assert (logits[0].float() - reference[0]).abs().max() < 0.05 * reference[0].abs().max()


@pytest.mark.parametrize("qtype", K_QUANT_TYPES, ids=lambda t: t.name)
def test_k_quant_blocks_read_back_within_one_step(qtype):
    """The test-side packer writes what gguf's dequantizer reads: every value back within one quantization step."""
    weights = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    weights[1] = 0.0
    weights[2] = np.abs(weights[2])
    back = dequantize(quantize_k(weights, qtype), qtype)
    levels = {GGMLQuantizationType.Q4_K: 15, GGMLQuantizationType.Q5_K: 31, GGMLQuantizationType.Q6_K: 63}[qtype]
    assert back.shape == weights.shape and not back[1].any()
    assert np.abs(back - weights).max() < (weights.max() - weights.min()) / levels


# ---- metadata: end tokens, tokenizer, cache, progress ---------------------------------------------------
def test_the_end_of_turn_token_the_metadata_names_is_an_end_token(gguf_file):
    path, _ = gguf_file("llama-gqa-untied", end_of_turn="<|eot_id|>")
    eng = Engine.from_pretrained(path, num_blocks=32)
    eot, eos = eng.tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert {eot, eos} <= eng.eos_token_ids
    assert eot not in Engine.from_pretrained(gguf_file("llama-gqa-untied")[0], num_blocks=8).eos_token_ids


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen2-gqa-tied", "phi3-gqa-untied"])
def test_tokenizer_and_chat_template_come_from_the_file(shape, gguf_file):
    path, reference = gguf_file(shape)
    from_gguf = Engine.from_pretrained(path, num_blocks=8)
    from_hf = Engine.from_pretrained(reference, num_blocks=8)
    # Llama's vocabulary has no <|endoftext|>: it stays text (transformers' GGUF builder invents it as id 512).
    for text in (PROMPT, "  two spaces\n\ttab <|endoftext|> é", ""):
        assert from_gguf.encode(text, at_start=True) == from_hf.encode(text, at_start=True)
    messages = [{"role": "user", "content": "Which way across the river?"}]
    assert from_gguf.format_chat(messages) == from_hf.format_chat(messages)
    ids = from_hf.encode(PROMPT, at_start=True)
    assert from_gguf.decode(ids) == from_hf.decode(ids)


def test_converted_tokenizer_is_cached_and_a_damaged_entry_is_rebuilt(gguf_file, monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    monkeypatch.setenv("DENDRITE_NB_CACHE", str(tmp_path))
    path, _ = gguf_file("qwen2-gqa-tied")
    first = Engine.from_pretrained(path, num_blocks=8).tokenizer
    entries = list(gguf_tokenizer.cache_root().iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()

    real = AutoTokenizer.from_pretrained

    def no_conversion(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the tokenizer was converted again instead of read from the cache"
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
        cached = Engine.from_pretrained(path, num_blocks=8).tokenizer
    assert cached.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    assert cached.chat_template == first.chat_template and cached.eos_token_id == first.eos_token_id

    (entries[0] / "tokenizer.json").write_text("{ not json")
    rebuilt = Engine.from_pretrained(path, num_blocks=8).tokenizer
    assert rebuilt.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    json.loads((entries[0] / "tokenizer.json").read_text())  # the entry was written again, whole


def test_a_big_file_shows_a_progress_bar_and_a_small_one_loads_silently(gguf_file, monkeypatch, capfd):
    import dendrite_nb.model.loader as loader

    path, _ = gguf_file("llama-mha-tied")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    Engine.from_pretrained(path, num_blocks=8)
    assert "loading" not in capfd.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)  # the tiny file now counts as big
    Engine.from_pretrained(path, num_blocks=8)
    err = capfd.readouterr().err
    assert f"loading {path.name}" in err and "tensors" in err, err


def test_a_session_on_a_gguf_saves_and_restores(gguf_file, tmp_path):
    path, _ = gguf_file("llama-mha-tied", "Q4_0")
    eng = Engine.from_pretrained(path, num_blocks=32)
    branch = eng.new_branch("a", PROMPT)
    expected = eng.next_logits([branch])
    restored = Engine.restore(eng.save(tmp_path / "session.dendrite"))
    assert torch.equal(restored.next_logits(["a"]), expected)


# ---- what a path may be --------------------------------------------------------------------------------
def next_logits(eng):
    return eng.next_logits([eng.new_branch("a", PROMPT)])


def test_a_folder_holding_one_gguf_loads_it(gguf_file, tmp_path):
    """Also beside a config.json without safetensors weights, as some GGUF repositories ship one."""
    path, reference = gguf_file("llama-mha-tied")
    expected = next_logits(Engine.from_pretrained(path, num_blocks=8))
    assert torch.equal(next_logits(Engine.from_pretrained(path.parent, num_blocks=8)), expected)
    shutil.copy(path, tmp_path)
    shutil.copy(reference / "config.json", tmp_path)
    assert torch.equal(next_logits(Engine.from_pretrained(tmp_path, num_blocks=8)), expected)


def test_a_folder_with_config_json_stays_an_hf_checkpoint(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("llama-mha-tied"), tmp_path / "hf")
    (folder / "notes.gguf").write_bytes(b"not a model")
    assert torch.equal(next_logits(Engine.from_pretrained(folder, num_blocks=8)),
                       next_logits(Engine.from_pretrained(checkpoint("llama-mha-tied"), num_blocks=8)))


def test_two_gguf_files_in_a_folder_are_refused_by_name(gguf_file, tmp_path):
    for qtype in ("F32", "Q8_0"):
        shutil.copy(gguf_file("llama-mha-tied", qtype)[0], tmp_path)
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(llama-mha-tied.F32.gguf, "
                                              r"llama-mha-tied.Q8_0.gguf\); pass the one to load"):
        Engine.from_pretrained(tmp_path)


def test_an_empty_folder_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config.json; expected an HF model folder .* or a GGUF"):
        Engine.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no GGUF file at"):
        Engine.from_pretrained(tmp_path / "model.Q4_K_M.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match="is a file, but not a GGUF file"):
        Engine.from_pretrained(tmp_path / "weights.bin")


# ---- bad files -----------------------------------------------------------------------------------------
def cache_entries():
    root = gguf_tokenizer.cache_root()
    return sorted(root.iterdir()) if root.is_dir() else []


@pytest.mark.parametrize("keep", [0.5, 0.999, 40])
def test_a_truncated_file_is_refused(keep, gguf_file, tmp_path):
    data = gguf_file("llama-mha-tied", "Q8_0")[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    before = cache_entries()
    with pytest.raises(CheckpointError, match=r"truncated|corrupt"):
        Engine.from_pretrained(cut)
    assert cache_entries() == before  # nothing was built or cached


def test_garbage_is_not_a_gguf_file(tmp_path):
    garbage = tmp_path / "model.gguf"
    noise = os.urandom(4096)
    garbage.write_bytes(noise)
    # The bytes as Python writes them: repr quotes them with " when they hold a ' (a fixed b'...' pattern failed so).
    with pytest.raises(CheckpointError, match=f"is not a GGUF file: it starts with {re.escape(repr(noise[:4]))}, "
                                              f"not GGUF's magic"):
        Engine.from_pretrained(garbage)
    garbage.write_bytes(b"GGUF" + os.urandom(4096))  # the magic, then noise where the header should be
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        Engine.from_pretrained(garbage)


def minimal_gguf(path, arch, tensors, fields=()):
    """A GGUF holding an architecture, these (name, bytes or floats, raw type) tensors and these reader fields."""
    writer = GGUFWriter(path, arch)
    for key, field in fields:
        element_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], element_type)
    for name, data, raw_type in tensors:
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["falcon", "gpt2", "mistral3"])
def test_an_unsupported_architecture_is_named(arch, tmp_path):
    path = minimal_gguf(tmp_path / "m.gguf", arch, [("token_embd.weight", np.zeros((8, 4), np.float32), None)])
    with pytest.raises(UnsupportedModel, match=rf"architecture '{arch}', which dendrite-nb does not run; it runs "
                                               r"GGUF architectures llama, qwen2, qwen3, phi3"):
        Engine.from_pretrained(path)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL"])
def test_an_unsupported_quantization_type_is_named(qtype, tmp_path):
    kind = GGMLQuantizationType[qtype]
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    raw = np.zeros((4, 256 // block_values * block_bytes), np.uint8)  # 4 rows of 256 values, all-zero blocks
    path = minimal_gguf(tmp_path / "m.gguf", "llama", [("blk.0.ffn_down.weight", raw, kind),
                                                       ("output_norm.weight", np.ones(256, np.float32), None)])
    with pytest.raises(UnsupportedModel, match=rf"1 tensor\(s\) of type {qtype} \(such as blk.0.ffn_down.weight\); "
                                               r"dendrite-nb reads GGUF tensors of type F32, F16, BF16, Q8_0"):
        Engine.from_pretrained(path)


def test_missing_metadata_and_mismatched_tensors_are_named(gguf_file, tmp_path):
    """A llama file with no hyperparameters, then one whose layer 1 lost a tensor."""
    reader = GGUFReader(gguf_file("llama-mha-tied")[0])
    tensors = [(t.name, np.array(t.data), None) for t in reader.tensors]
    path = minimal_gguf(tmp_path / "no-metadata.gguf", "llama", tensors)
    with pytest.raises(CheckpointError, match=r"no 'llama.attention.head_count' in its metadata"):
        Engine.from_pretrained(path)

    fields = [(key, field) for key, field in reader.fields.items()
              if not key.startswith(("GGUF.", "general.architecture"))]
    kept = [tensor for tensor in tensors if tensor[0] != "blk.1.ffn_up.weight"]
    path = minimal_gguf(tmp_path / "short.gguf", "llama", kept, fields)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) blk.1.ffn_up.weight"):
        Engine.from_pretrained(path)
