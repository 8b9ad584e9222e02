"""Hostile save files and save paths.

A save file's SHA-256 sits beside the manifest it checks, so whoever edits the manifest can recompute it: the
checksum catches accidents, not edits. Each case below edits a real save's manifest (or its tensors), recomputes
every checksum, and expects a SaveFileError naming what is wrong (before this, such files raised KeyError,
TypeError, AssertionError, ... or were restored into a broken session), with another engine's tree, block
table and free blocks untouched. Saves turn every file-system failure into a SaveFileError saying what to do, and
delete the temporaries that killed saves left behind.
"""
import errno
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dendrite_nb
from dendrite_nb import Engine, SamplingParams, SaveFileError
from dendrite_nb.persist_write import HOST, MARK, STALE_AFTER_S, temporary_prefix
from dendrite_nb.testing import TINY_SHAPES

from tests.support.engines import engine_state

CONFIG = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)


def make_session(folder, kv_dtype=None):
    """A saved session with every part a manifest can hold: a trunk whose forks start mid-block, sampled
    branches (generator states) with log-probabilities, a branch preempted to host memory (a `preempted/<i>`
    tensor), one preempted by dropping its KV (none), and an empty branch at the root. Node order: 0 trunk,
    1 trunk/0, 2 trunk/1 (host), 3 trunk/2 (dropped); branch order: trunk, trunk/0, trunk/1, trunk/2, empty."""
    eng = Engine.from_random(CONFIG, weight_seed=5, num_blocks=32, block_size=4, kv_dtype=kv_dtype, seed=7)
    trunk = eng.new_branch("trunk", list(range(3, 14)))
    kids = eng.fork(trunk, 3)
    eng.generate(kids, 4, SAMPLED, logprobs=True)
    eng.preempt(kids[1])
    eng.host_memory_limit_bytes = 0
    eng.preempt(kids[2])
    eng.new_branch("empty", [])
    return eng, eng.save(folder / "session.dendrite")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rewrite(source, target, edit=None, text_edit=None):
    """Copy a save file with its manifest (and tensors) edited and every checksum recomputed, as someone who
    edits a file can. `edit(manifest, tensors)` changes them in place or returns a new manifest;
    `text_edit(text)` edits the manifest's JSON text itself."""
    with safe_open(str(source), framework="pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    manifest = json.loads(metadata["dendrite"])
    if edit is not None:
        replaced = edit(manifest, tensors)
        manifest = manifest if replaced is None else replaced
    if isinstance(manifest, dict) and isinstance(manifest.get("tensors"), dict):
        manifest["tensors"] = {name: sha(t.contiguous().view(torch.uint8).numpy().tobytes())
                               for name, t in tensors.items()}
    text = json.dumps(manifest)
    if text_edit is not None:
        text = text_edit(text)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(target),
              metadata={"dendrite": text, "dendrite_sha256": sha(text.encode())})
    return target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return make_session(tmp_path_factory.mktemp("saved"))


@pytest.fixture(scope="module")
def saved_fp8(tmp_path_factory):
    return make_session(tmp_path_factory.mktemp("saved_fp8"), kv_dtype="fp8")


@pytest.fixture(scope="module")
def bystander():
    """Another engine in the same process: no restore may change it."""
    eng = Engine.from_random(CONFIG, weight_seed=1, num_blocks=16, block_size=4)
    kids = eng.fork(eng.new_branch("other", [5, 6, 7, 8, 9]), 2)
    eng.generate(kids, 3, SAMPLED)
    return eng


def refused(path, bystander, message, **overrides):
    before = engine_state(bystander)
    with pytest.raises(SaveFileError, match=message):
        Engine.restore(path, **overrides)
    assert engine_state(bystander) == before
    bystander.audit()


def set_(path, value):
    """An edit that sets manifest[path[0]][path[1]]... to `value`."""
    def edit(manifest, tensors):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        manifest[last] = value
    return edit


def delete(path):
    def edit(manifest, tensors):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        del manifest[last]
    return edit


def tensor(name, change):
    def edit(manifest, tensors):
        if change is None:
            del tensors[name]
        else:
            tensors[name] = change(tensors[name])
    return edit


def both(*edits):
    def edit(manifest, tensors):
        for one in edits:
            one(manifest, tensors)
    return edit


NOT_FORMAT = r"is not a 'dendrite-nb session' version 1 file"
CASES = [
    # the manifest as a whole
    ("not an object", lambda m, t: [], NOT_FORMAT),
    ("version 2", set_(["version"], 2), NOT_FORMAT),
    ("version true", set_(["version"], True), NOT_FORMAT),
    ("version text", set_(["version"], "1"), NOT_FORMAT),
    ("another format", set_(["format"], "pickle"), NOT_FORMAT),
    ("missing key", delete(["nodes"]), r"lacks the key 'nodes'"),
    ("unknown key", set_(["extra"], 1), r"holds the key 'extra'"),
    ("tensor sums not an object", set_(["tensors"], "x"), r"field tensors"),
    # model and source
    ("fingerprint not hex", set_(["model", "fingerprint"], "z" * 64), r"model\.fingerprint"),
    ("config not an object", set_(["model", "config"], []), r"model\.config"),
    ("config lacks vocab_size", delete(["model", "config", "vocab_size"]), r"model\.config lacks the key 'vocab_size'"),
    ("vocab_size text", set_(["model", "config", "vocab_size"], "256"), r"model\.config\.vocab_size"),
    ("vocab_size smaller", both(set_(["model", "config", "vocab_size"], 8),
                                set_(["source", "hf_config", "vocab_size"], 8)), r"nodes\[0\]\.tokens"),
    ("config disagrees with hf_config", set_(["model", "config", "hidden_size"], 128),
     r"hf_config \(its hidden_size\)"),
    ("config disagrees with the model", set_(["model", "config", "rms_norm_eps"], 0.5), r"rebuilt .* rms_norm_eps"),
    ("source a list", set_(["source"], []), r"field source "),
    ("source with both", set_(["source", "checkpoint"], "/x"), r"field source holds the key 'hf_config'"),
    ("checkpoint not text", set_(["source"], {"checkpoint": 5}), r"source\.checkpoint"),
    ("checkpoint with NUL", set_(["source"], {"checkpoint": "/a\x00b"}), r"source\.checkpoint"),
    ("checkpoint missing", set_(["source"], {"checkpoint": "/nonexistent/model"}), r"cannot rebuild the engine"),
    ("hf_config a list", set_(["source", "hf_config"], [1]), r"source\.hf_config"),
    ("hf_config lacks heads", delete(["source", "hf_config", "num_attention_heads"]), r"source\.hf_config is not"),
    ("hf_config rope a number", set_(["source", "hf_config", "rope_parameters"], 5), r"source\.hf_config is not"),
    ("weight_seed text", set_(["source", "weight_seed"], "5"), r"source\.weight_seed"),
    ("weight_seed other", set_(["source", "weight_seed"], 6), r"not the one it was saved with"),
    # engine settings
    ("dtype unknown", set_(["dtype"], "float64"), r"field dtype "),
    ("kv_dtype a list", set_(["kv_dtype"], ["float32"]), r"field kv_dtype"),
    ("kv_dtype other", set_(["kv_dtype"], "bfloat16"), r"tensor 'kv'"),
    ("block_size text", set_(["block_size"], "4"), r"field block_size"),
    ("block_size true", set_(["block_size"], True), r"field block_size"),
    ("block_size zero", set_(["block_size"], 0), r"field block_size"),
    ("block_size other", set_(["block_size"], 3), r"nodes\[0\]: 11 tokens .* take 4 blocks of 3"),
    ("num_blocks negative", set_(["num_blocks"], -1), r"field num_blocks"),
    ("num_blocks huge", set_(["num_blocks"], 10**30), r"field num_blocks"),
    ("num_blocks float", set_(["num_blocks"], 32.0), r"field num_blocks"),
    ("device unknown", set_(["device"], "tpu"), r"field device"),
    ("options a list", set_(["options"], []), r"field options "),
    ("option unknown", set_(["options", "evil"], 1), r"options holds the key 'evil'"),
    ("option seed text", set_(["options", "seed"], "x"), r"options\.seed"),
    ("option debug int", set_(["options", "debug"], 1), r"options\.debug"),
    ("option attention int", set_(["options", "attention"], 5), r"options\.attention"),
    ("next_node_id taken", set_(["next_node_id"], 2), r"next_node_id"),
    ("next_node_id none", set_(["next_node_id"], None), r"next_node_id"),
    # nodes
    ("nodes an object", set_(["nodes"], {}), r"field nodes "),
    ("node lacks tokens", delete(["nodes", 1, "tokens"]), r"nodes\[1\] lacks the key 'tokens'"),
    ("node unknown key", set_(["nodes", 1, "code"], "x"), r"nodes\[1\] holds the key 'code'"),
    ("node id text", set_(["nodes", 1, "id"], "2"), r"nodes\[1\]\.id"),
    ("node id twice", set_(["nodes", 1, "id"], 1), r"nodes\[1\]\.id"),
    ("parent out of range", set_(["nodes", 1, "parent"], 99), r"nodes\[1\]\.parent"),
    ("parent itself", set_(["nodes", 1, "parent"], 1), r"nodes\[1\]\.parent"),
    ("parents a cycle", both(set_(["nodes", 0, "parent"], 1), set_(["nodes", 1, "parent"], 0)), r"nodes\[0\]\.parent"),
    ("parent below root", set_(["nodes", 1, "parent"], -2), r"nodes\[1\]\.parent"),
    ("parent float", set_(["nodes", 1, "parent"], 0.0), r"nodes\[1\]\.parent"),
    ("start past parent's end", set_(["nodes", 1, "start"], 12), r"nodes\[1\]\.start"),
    ("start text", set_(["nodes", 1, "start"], "11"), r"nodes\[1\]\.start"),
    ("token past vocab", set_(["nodes", 0, "tokens", 2], 256), r"nodes\[0\]\.tokens"),
    ("token negative", set_(["nodes", 0, "tokens", 2], -1), r"nodes\[0\]\.tokens"),
    ("token huge", set_(["nodes", 0, "tokens", 2], 10**30), r"nodes\[0\]\.tokens"),
    ("token bool", set_(["nodes", 0, "tokens", 2], True), r"nodes\[0\]\.tokens"),
    ("token float", set_(["nodes", 0, "tokens", 2], 5.0), r"nodes\[0\]\.tokens"),
    ("tokens none", set_(["nodes", 0, "tokens"], None), r"nodes\[0\]\.tokens"),
    ("tokens past the context", set_(["nodes", 0, "tokens"], [1] * 2049), r"nodes\[0\]\.tokens"),
    ("block past the saved KV", set_(["nodes", 1, "blocks", 0], 5), r"block 5, past the 5 blocks"),
    ("block huge", set_(["nodes", 1, "blocks", 0], 2**40), r"nodes\[1\]\.blocks"),
    ("block negative", set_(["nodes", 1, "blocks", 0], -1), r"nodes\[1\]\.blocks"),
    ("block held twice", set_(["nodes", 1, "blocks", 0], 0), r"block 0 is held by 2 nodes"),
    ("blocks too few", set_(["nodes", 1, "blocks"], [3]), r"nodes\[1\]: 4 tokens .* take 2 blocks"),
    ("blocks too many", set_(["nodes", 0, "blocks"], [0, 1, 2, 5]), r"nodes\[0\]: 11 tokens .* take 3 blocks"),
    ("preempted negative", set_(["nodes", 2, "preempted"], -1), r"nodes\[2\]\.preempted"),
    ("preempted and held", set_(["nodes", 1, "preempted"], 2), r"nodes\[1\]: .*not both"),
    ("logprob index past tokens", set_(["nodes", 1, "logprobs"], {"7": -1.0}), r"nodes\[1\]\.logprobs"),
    ("logprob index not canonical", set_(["nodes", 1, "logprobs"], {"01": -1.0}), r"nodes\[1\]\.logprobs"),
    ("logprob index huge", set_(["nodes", 1, "logprobs"], {"9" * 5000: -1.0}), r"nodes\[1\]\.logprobs"),
    ("logprob text", set_(["nodes", 1, "logprobs"], {"0": "x"}), r"nodes\[1\]\.logprobs\[0\]"),
    ("logprobs a list", set_(["nodes", 1, "logprobs"], [-1.0]), r"nodes\[1\]\.logprobs"),
    ("hidden row past nodes", set_(["hidden_nodes", 3], 4), r"hidden_nodes"),
    ("hidden row twice", set_(["hidden_nodes", 3], 0), r"hidden_nodes"),
    ("hidden rows text", set_(["hidden_nodes"], "0123"), r"hidden_nodes"),
    # branches
    ("branches an object", set_(["branches"], {}), r"field branches "),
    ("branch lacks node", delete(["branches", 1, "node"]), r"branches\[1\] lacks the key 'node'"),
    ("name empty", set_(["branches", 1, "name"], ""), r"branches\[1\]\.name"),
    ("name an int", set_(["branches", 1, "name"], 5), r"branches\[1\]\.name"),
    ("name none", set_(["branches", 1, "name"], None), r"branches\[1\]\.name"),
    ("name a lone surrogate", set_(["branches", 1, "name"], "a\ud800"), r"lone surrogates"),
    ("name twice", set_(["branches", 1, "name"], "trunk"), r"'trunk' appears twice"),
    ("branch node missing", set_(["branches", 1, "node"], 4), r"branches\[1\]\.node"),
    ("branch node text", set_(["branches", 1, "node"], "1"), r"branches\[1\]\.node"),
    ("seed negative", set_(["branches", 1, "seed"], -1), r"branches\[1\]\.seed"),
    ("seed past 64 bits", set_(["branches", 1, "seed"], 2**64), r"branches\[1\]\.seed"),
    ("seed float", set_(["branches", 1, "seed"], 1.5), r"branches\[1\]\.seed"),
    ("generator text", set_(["branches", 1, "generator"], "yes"), r"branches\[1\]\.generator"),
    ("generator state unexplained", set_(["branches", 1, "generator"], False), r"tensor 'generator/1'"),
    ("generator state missing", set_(["branches", 0, "generator"], True), r"lacks the tensor 'generator/0'"),
    ("constraint a list", set_(["branches", 1, "constraint"], []), r"branches\[1\]\.constraint"),
    ("constraint two kinds", set_(["branches", 1, "constraint"], {"regex": "a", "choices": ["b"]}),
     r"branches\[1\]\.constraint"),
    ("constraint unknown kind", set_(["branches", 1, "constraint"], {"python": "import os"}),
     r"branches\[1\]\.constraint"),
    ("constraint without a tokenizer", set_(["branches", 1, "constraint"], {"regex": "a+"}), r"no tokenizer"),
    ("constraint_from past the branch", set_(["branches", 1, "constraint_from"], 16), r"constraint_from"),
    ("priority text", set_(["branches", 1, "priority"], "high"), r"branches\[1\]\.priority"),
    ("priority nan", set_(["branches", 1, "priority"], math.nan), r"branches\[1\]\.priority"),
    ("priority infinite", set_(["branches", 1, "priority"], math.inf), r"branches\[1\]\.priority"),
    ("priority huge int", set_(["branches", 1, "priority"], 10**400), r"branches\[1\]\.priority"),
    ("chat a list", set_(["branches", 1, "chat"], []), r"branches\[1\]\.chat"),
    ("chat lacks mark", set_(["branches", 1, "chat"], {"messages": [], "generation_prompt": True}),
     r"branches\[1\]\.chat lacks the key 'mark'"),
    ("chat message not a pair", set_(["branches", 1, "chat"], {"messages": [["user"]], "mark": 0,
                                                                "generation_prompt": True}), r"chat\.messages\[0\]"),
    ("chat role an int", set_(["branches", 1, "chat"], {"messages": [[5, "hi"]], "mark": 0,
                                                         "generation_prompt": True}), r"chat\.messages\[0\]"),
    ("chat mark past the branch", set_(["branches", 1, "chat"], {"messages": [], "mark": 16,
                                                                  "generation_prompt": True}), r"chat\.mark"),
    ("chat flag an int", set_(["branches", 1, "chat"], {"messages": [], "mark": 0, "generation_prompt": 1}),
     r"chat\.generation_prompt"),
    ("node no branch reaches", set_(["branches", 1, "node"], -1), r"nodes\[1\] is no branch's node and no node's parent"),
    ("eos a word", set_(["eos_token_ids"], "eos"), r"eos_token_ids should be a list"),
    ("eos past the vocabulary", set_(["eos_token_ids"], [10**6]), r"eos_token_ids"),
    ("eos twice", set_(["eos_token_ids"], [2, 2]), r"eos_token_ids should be token ids listed once each"),
    # tensors
    ("kv another dtype", tensor("kv", lambda t: t.double()), r"tensor 'kv' .* float64"),
    ("kv a block short", tensor("kv", lambda t: t[:, :, :-1]), r"tensor 'kv'"),
    ("kv missing", tensor("kv", None), r"lacks the tensor 'kv'"),
    ("hidden a row short", tensor("hidden", lambda t: t[:-1]), r"tensor 'hidden'"),
    ("hidden another dtype", tensor("hidden", lambda t: t.half()), r"tensor 'hidden'"),
    ("generator state short", tensor("generator/1", lambda t: t[:16]), r"sampling-generator state"),
    ("generator state int64", tensor("generator/1", lambda t: t.long()), r"tensor 'generator/1'"),
    ("preempted KV another shape", tensor("preempted/2", lambda t: t[..., :8]), r"tensor 'preempted/2'"),
    ("preempted KV for a resident node", lambda m, t: t.update({"preempted/1": t["preempted/2"].clone()}),
     r"tensor 'preempted/1' its manifest does not explain"),
    ("unknown tensor", lambda m, t: t.update(evil=torch.zeros(3)), r"tensor 'evil' its manifest does not explain"),
]


@pytest.mark.parametrize("edit, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_crafted_manifest_with_its_checksums_recomputed_is_refused(saved, bystander, tmp_path, edit, message):
    _, path = saved
    refused(rewrite(path, tmp_path / "crafted.dendrite", edit), bystander, message)


FP8_CASES = [
    ("scales a block short", tensor("kv_scales", lambda t: t[:, :, :-1]), r"tensor 'kv_scales'"),
    ("scales missing", tensor("kv_scales", None), r"lacks the tensor 'kv_scales'"),
    ("scales another dtype", tensor("kv_scales", lambda t: t.half()), r"tensor 'kv_scales'"),
    ("preempted scales missing", tensor("preempted_scales/2", None), r"lacks the tensor 'preempted_scales/2'"),
    ("scales on a float32 cache", set_(["kv_dtype"], "float32"), r"tensor 'kv'"),
]


@pytest.mark.parametrize("edit, message", [case[1:] for case in FP8_CASES], ids=[case[0] for case in FP8_CASES])
def test_crafted_fp8_tensors_are_refused(saved_fp8, bystander, tmp_path, edit, message):
    _, path = saved_fp8
    refused(rewrite(path, tmp_path / "crafted.dendrite", edit), bystander, message)


@pytest.mark.parametrize("text_edit, message", [
    (lambda text: text.replace('"num_blocks": 32', '"num_blocks": 32, "num_blocks": 4'), r"'num_blocks' appears twice"),
    (lambda text: text[:-1], r"not plain JSON"),
    (lambda text: "[" * 100_000 + "]" * 100_000, r"not plain JSON|not a 'dendrite-nb session'"),
    (lambda text: text.replace('"name": "trunk"', '"name": "\\ud800"'), r"lone surrogates"),
], ids=["repeated key", "not JSON", "nested past the stack", "escaped lone surrogate"])
def test_a_manifest_that_is_not_plain_json_is_refused(saved, bystander, tmp_path, text_edit, message):
    _, path = saved
    refused(rewrite(path, tmp_path / "crafted.dendrite", text_edit=text_edit), bystander, message)


@pytest.mark.parametrize("edit", [
    None,
    delete(["branches", 1, "chat"]),   # files saved before chat() existed
    delete(["eos_token_ids"]),   # files saved before the engine's end tokens were kept
    set_(["branches", 4, "chat"], {"messages": [["user", "Hi"]], "mark": 0, "generation_prompt": True}),
    set_(["branches", 1, "priority"], 3),
], ids=["unedited", "no chat key", "no eos_token_ids", "a chat state", "an int priority"])
def test_a_rewritten_file_that_is_still_valid_restores(saved, tmp_path, edit):
    """The control: the rewriting above is sound, and what the checks allow restores and decodes on, as the
    file restored unedited does (preempted branches resume from host memory and by recomputing)."""
    _, path = saved
    expected = Engine.restore(path)
    restored = Engine.restore(rewrite(path, tmp_path / "rewritten.dendrite", edit))
    restored.audit()
    assert {n: b.tokens for n, b in restored.branches.items()} == {n: b.tokens for n, b in expected.branches.items()}
    names = ["trunk/0", "trunk/1", "trunk/2"]
    assert restored.generate(names, 3, SAMPLED) == expected.generate(names, 3, SAMPLED)
    restored.audit()


def test_a_restore_that_fails_after_building_closes_what_it_built(saved, bystander, tmp_path):
    """A file refused once its engine is built (another model config) leaves no half-built engine alive."""
    _, path = saved
    built = []
    real = Engine.from_random.__func__

    def recording(cls, *args, **kwargs):
        built.append(real(cls, *args, **kwargs))
        return built[-1]

    crafted = rewrite(path, tmp_path / "crafted.dendrite", set_(["model", "config", "rms_norm_eps"], 0.5))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "from_random", classmethod(recording))
        refused(crafted, bystander, "rms_norm_eps")
    assert len(built) == 1 and built[0].closed


def test_a_restore_unpickles_nothing(saved, monkeypatch):
    """Restoring reads JSON and raw tensors only: with every unpickler disabled, a session still restores."""
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("a restore unpickled something")

    for owner, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(owner, name, refuse)
    _, path = saved
    Engine.restore(path).audit()


# ---- save paths ---------------------------------------------------------------------------------------------------
@pytest.fixture
def small(tmp_path):
    eng = Engine.from_random(CONFIG, weight_seed=2, num_blocks=8, block_size=4)
    eng.new_branch("a", [1, 2, 3, 4, 5])
    return eng


def test_a_name_too_long_is_a_save_file_error(small, tmp_path):
    with pytest.raises(SaveFileError, match="too long"):
        small.save(tmp_path / ("x" * 300))
    with pytest.raises(SaveFileError, match="cannot read .* too long"):
        Engine.restore(tmp_path / ("x" * 300))
    assert list(tmp_path.iterdir()) == []


def test_a_long_name_that_fits_saves(small, tmp_path):
    """A 250-byte name is a valid file name; its temporary's name is shortened to fit, not refused."""
    target = small.save(tmp_path / ("y" * 250))
    assert Engine.restore(target).branches["a"].tokens == [1, 2, 3, 4, 5]
    assert [p.name for p in tmp_path.iterdir()] == ["y" * 250]


def test_a_symlink_loop_is_a_save_file_error(small, tmp_path):
    loop = tmp_path / "loop.dendrite"
    loop.symlink_to(loop)
    with pytest.raises(SaveFileError, match="loop of symbolic links"):
        small.save(loop)
    with pytest.raises(SaveFileError, match="loop of symbolic links"):
        small.save(loop / "inside.dendrite")
    assert [p.name for p in tmp_path.iterdir()] == ["loop.dendrite"]


def test_a_missing_folder_is_made_and_a_file_in_the_way_is_refused(small, tmp_path):
    assert small.save(tmp_path / "a" / "b" / "s.dendrite").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SaveFileError, match="part of its folder path is a file"):
        small.save(tmp_path / "file" / "s.dendrite")
    with pytest.raises(SaveFileError, match="is a folder"):
        small.save(tmp_path / "a")


def test_a_pipe_is_not_replaced_by_a_save(small, tmp_path):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(SaveFileError, match="not a regular file"):
        small.save(pipe)
    assert pipe.is_fifo()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_a_save_file_error(small, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(SaveFileError, match="permission denied"):
            small.save(folder / "s.dendrite")
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("code, message", [(errno.EROFS, "read-only"), (errno.EACCES, "permission denied"),
                                           (errno.ENOSPC, "disk is full")])
def test_a_failed_rename_is_a_save_file_error_and_keeps_the_old_file(small, tmp_path, monkeypatch, code, message):
    """What root cannot be shown with chmod: the rename into place fails as on a read-only or full disk."""
    target = small.save(tmp_path / "s.dendrite")
    before = target.read_bytes()
    small.new_branch("b", [9, 9])

    def failing(source, destination):
        raise OSError(code, os.strerror(code), str(destination))

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(SaveFileError, match=message):
        small.save(target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.dendrite"]


def test_ctrl_c_during_a_save_keeps_the_old_file_and_leaves_no_temporary(small, tmp_path, monkeypatch):
    import dendrite_nb.persist as persist

    target = small.save(tmp_path / "s.dendrite")
    before = target.read_bytes()

    def interrupted(tensors, filename, metadata):
        open(filename, "wb").write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(persist, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        small.save(target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.dendrite"]


# ---- stale temporaries --------------------------------------------------------------------------------------------
def dead_pid() -> int:
    """The id of a process that has ended (ids are reused only after the whole range wraps)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_deletes_the_stale_temporaries_of_its_target_only(small, tmp_path):
    target = tmp_path / "s.dendrite"
    prefix = temporary_prefix(target)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        old = time.time() - STALE_AFTER_S - 60
        files = {
            f"{prefix}{HOST}-{dead_pid()}-abcd1234": "stale",          # its writer has ended
            f"{prefix}{HOST}-{os.getpid()}-efgh5678": "stale",         # this process's, from a save that ended
            f"{prefix}otherhost-{os.getpid()}-ijkl9012": "old",        # another host's, untouched for too long
            f"{prefix}otherhost-1-mnop3456": "kept",                   # another host's, fresh: maybe still writing
            f"{prefix}{HOST}-{sleeper.pid}-qrst7890": "kept",          # its writer is still running
            f"{temporary_prefix(tmp_path / 'other')}{HOST}-{dead_pid()}-uvwx1234": "kept",   # another target's
            ".s.dendrite.x1b2c3d4": "kept",                           # not this naming at all
            f"s.dendrite{MARK}{HOST}-{dead_pid()}-yzab5678": "kept",   # no leading dot: not a temporary
        }
        for name, kind in files.items():
            (tmp_path / name).write_bytes(b"partial")
            if kind == "old":
                os.utime(tmp_path / name, (old, old))
        folder = f"{prefix}{HOST}-{dead_pid()}-folder12"
        (tmp_path / folder).mkdir()   # a folder is never deleted
        small.save(target)
        kept = {name for name, kind in files.items() if kind == "kept"}
        assert {p.name for p in tmp_path.iterdir()} == kept | {folder, "s.dendrite"}
    finally:
        sleeper.kill()
        sleeper.wait()


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import dendrite_nb.persist as persist
    from dendrite_nb import Engine
    from dendrite_nb.testing import TINY_SHAPES

    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=8, block_size=4)
    eng.new_branch("a", [1, 2, 3, 4, 5, 6])
    real = persist.save_file

    def write_then_die(*args, **kwargs):   # killed mid-save: the temporary is written, the rename never comes
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    persist.save_file = write_then_die
    eng.save(sys.argv[1])
""")


def test_a_killed_save_leaves_the_old_file_and_the_next_save_deletes_its_temporary(small, tmp_path):
    target = small.save(tmp_path / "s.dendrite")
    before = target.read_bytes()
    package_root = os.path.dirname(os.path.dirname(dendrite_nb.__file__))   # the child imports this same code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(target)], env=env, capture_output=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert target.read_bytes() == before
    left = [p.name for p in tmp_path.iterdir() if p.name != "s.dendrite"]
    assert len(left) == 1 and left[0].startswith(temporary_prefix(target)), left
    small.save(target)
    assert [p.name for p in tmp_path.iterdir()] == ["s.dendrite"]


@pytest.fixture(scope="module")
def saved_constrained(checkpoint, tmp_path_factory):
    """A session on a checkpoint (it has a tokenizer) with a branch decoded under a constraint."""
    eng = Engine.from_pretrained(checkpoint(), num_blocks=32, block_size=4)
    eng.generate([eng.new_branch("asked", "Answer:")], 2, SAMPLED, constraint={"choices": ["yes", "no"]})
    return eng.save(tmp_path_factory.mktemp("constrained") / "session.dendrite")


@pytest.mark.parametrize("constraint, message", [
    ({"choices": ["zzzz"]}, r"tokens after position .* are not ones its saved constraint allows"),
    ({"regex": "("}, r"branches\[0\]\.constraint is not a valid constraint"),
    ({"json_schema": {"type": "nonsense"}}, r"branches\[0\]\.constraint is not a valid constraint"),
], ids=["tokens it refuses", "a regex that does not compile", "a schema that is not one"])
def test_a_crafted_constraint_is_refused(saved_constrained, bystander, tmp_path, constraint, message):
    crafted = rewrite(saved_constrained, tmp_path / "crafted.dendrite", set_(["branches", 0, "constraint"], constraint))
    refused(crafted, bystander, message)
