"""Engine.save / Engine.restore: a restored session decodes exactly as the uninterrupted one, and every bad
file (truncated, bit-flipped, another model, dtype or block size) is refused with a SaveFileError."""
import os
import stat

import pytest
import torch

from dendrite_nb import Engine, SamplingParams, SaveFileError
from dendrite_nb.testing import TINY_SHAPES

SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]}


def grow_session(eng: Engine) -> list[str]:
    """A tree with a mid-block fork, sampled branches (generator states in use) and a half-done constraint."""
    trunk = eng.new_branch("trunk", "A tree of thought, with branches that share")
    eng.generate([trunk], 3, GREEDY)
    kids = eng.fork(trunk, 3)
    eng.set_priority(kids[1], 2.5)
    eng.generate(kids, 5, SAMPLED)
    asked = eng.new_branch("asked", "Answer in JSON:")
    eng.generate([asked], 2, SAMPLED, constraint={"json_schema": SCHEMA})
    return [k.name for k in kids] + ["asked"]


def continue_session(eng: Engine, names: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    tokens = eng.generate(names, 6, SAMPLED)
    return tokens, eng.next_logits(names)


def structure(eng: Engine) -> dict:
    return {name: (b.tokens, b.seed, b.node.id, b.priority) for name, b in eng.branches.items()}


@pytest.fixture
def saved(checkpoint, tmp_path):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4, debug=True)
    names = grow_session(eng)
    path = eng.save(tmp_path / "session.dendrite")
    return eng, names, path


def test_a_restored_session_decodes_exactly_as_the_uninterrupted_one(saved):
    eng, names, path = saved
    restored = Engine.restore(path)
    assert structure(restored) == structure(eng)
    assert restored.num_free_blocks == eng.num_free_blocks
    assert torch.equal(restored.next_logits(names), eng.next_logits(names))
    expected_tokens, expected_logits = continue_session(eng, names)
    tokens, logits = continue_session(restored, names)
    assert tokens == expected_tokens
    assert torch.equal(logits, expected_logits)
    assert restored.branch("asked").matcher.is_accepting() == eng.branch("asked").matcher.is_accepting()
    restored.audit()


def test_random_weight_and_fp8_sessions_round_trip(tmp_path):
    cfg = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256)
    eng = Engine.from_random(cfg, weight_seed=3, kv_dtype="fp8", num_blocks=32, block_size=4)
    kids = eng.fork(eng.new_branch("root", list(range(11))), 2)
    eng.generate(kids, 4, SAMPLED)
    restored = Engine.restore(eng.save(tmp_path / "s"))
    assert restored.kv_dtype == torch.float8_e4m3fn
    assert continue_session(restored, ["root/0", "root/1"])[0] == continue_session(eng, ["root/0", "root/1"])[0]


def test_save_replaces_the_file_atomically_and_a_failed_save_keeps_the_old_one(saved, monkeypatch):
    eng, _, path = saved
    before = path.read_bytes()
    import dendrite_nb.persist as persist

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(persist, "save_file", crash)
    eng.new_branch("extra", "more")
    with pytest.raises(SaveFileError, match="disk full"):   # not a bare OSError: what failed, and what to do
        eng.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.skipif(os.name != "posix", reason="permission bits are POSIX")
def test_a_save_file_gets_the_permissions_of_any_new_file_and_an_overwrite_keeps_its_own(saved):
    eng, _, path = saved
    umask = os.umask(0o022)
    try:
        fresh = eng.save(path.parent / "fresh.dendrite")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644  # not mkstemp's owner-only 0600
        os.chmod(fresh, 0o640)
        eng.save(fresh)
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
    finally:
        os.umask(umask)


def flip_byte(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated or corrupted"),
    (lambda p: p.write_bytes(b""), "truncated or corrupted"),
    (lambda p: flip_byte(p, 10), "fails its checksum"),
    (lambda p: os.remove(p), "no save file"),
])
def test_damaged_files_are_refused(saved, damage, message):
    _, _, path = saved
    damage(path)
    with pytest.raises(SaveFileError, match=message):
        Engine.restore(path)


def test_a_flipped_bit_in_the_manifest_is_refused(saved):
    _, _, path = saved
    data = bytearray(path.read_bytes())
    at = data.index(b'start\\"')  # inside the manifest: a JSON string within the safetensors header
    data[at + 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SaveFileError):
        Engine.restore(path)


def test_another_model_dtype_or_block_size_is_refused(saved, checkpoint):
    _, _, path = saved
    with pytest.raises(SaveFileError, match="not the one it was saved with"):
        Engine.restore(path, checkpoint=checkpoint("llama-mha-tied"))
    with pytest.raises(SaveFileError, match="dtype=float32, not bfloat16"):
        Engine.restore(path, dtype="bfloat16")
    with pytest.raises(SaveFileError, match="block_size=4, not 16"):
        Engine.restore(path, block_size=16)
    with pytest.raises(TypeError, match="unexpected options"):
        Engine.restore(path, seed=3)


def test_an_engine_around_a_bare_model_cannot_be_saved(checkpoint, tmp_path):
    base = Engine.from_pretrained(checkpoint(), num_blocks=8)
    bare = Engine(base.model, base.tokenizer, num_blocks=8)
    with pytest.raises(SaveFileError, match="from_pretrained or Engine.from_random"):
        bare.save(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_end_tokens_set_on_the_engine_are_checked_and_saved(checkpoint, tmp_path):
    """eos_token_ids took any iterable (a str became its letters) and a restore dropped what was set."""
    eng = Engine.from_pretrained(checkpoint(), num_blocks=32, block_size=4)
    default = eng.eos_token_ids
    for bad, error in [("abc", TypeError), (None, TypeError), ([10**9], ValueError), ([1.5], ValueError)]:
        with pytest.raises(error):
            eng.eos_token_ids = bad
        assert eng.eos_token_ids == default
    eng.eos_token_ids = [5, 7]
    eng.new_branch("a", "end tokens")
    eng.save(tmp_path / "s.dendrite")
    assert Engine.restore(tmp_path / "s.dendrite").eos_token_ids == {5, 7}


def test_a_bad_override_is_named_as_the_callers_not_blamed_on_the_file(checkpoint, tmp_path):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=32, block_size=4)
    eng.new_branch("a", "overrides")
    eng.save(tmp_path / "s.dendrite")
    with pytest.raises(SaveFileError, match=r"with the overrides \{'attention': 'flash'\}: attention backend 'flash' "
                                            r"is not available; choose one of [^.]*\.$"):
        Engine.restore(tmp_path / "s.dendrite", attention="flash")
