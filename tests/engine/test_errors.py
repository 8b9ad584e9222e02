"""Bad input gets a clear, typed error and changes nothing: tree, block table and free blocks stay as they were."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dendrite_nb import (BranchExists, BranchPruned, CheckpointError, ContextOverflow, EmptyBranch, Engine,
                         OutOfBlocks, SamplingParams, UnknownBranch, UnsupportedModel)

from tests.support.engines import engine_state, interrupt_forward_call


@pytest.fixture
def populated(engine):
    a = engine.new_branch("a", "Some text to start the tree with")
    kids = engine.fork(a, 2)
    engine.generate(kids, 3, SamplingParams(temperature=0.0))
    pruned = engine.fork(a, names=["gone"])[0]
    engine.prune(pruned)
    return engine, a, kids, pruned


BAD_CALLS = {
    "append to unknown branch": (lambda e, a, k, p: e.append("nope", "x"), UnknownBranch, "no branch named 'nope'"),
    "fork unknown branch": (lambda e, a, k, p: e.fork("nope", 2), UnknownBranch, "create it with new_branch or fork"),
    "generate on unknown branch": (lambda e, a, k, p: e.generate([a, "nope"], 4), UnknownBranch, "'nope'"),
    "prune unknown branch with a good one": (lambda e, a, k, p: e.prune(k[0], "nope"), UnknownBranch, "'nope'"),
    "logits of unknown branch": (lambda e, a, k, p: e.next_logits(["nope"]), UnknownBranch, "'nope'"),
    "fork a pruned branch": (lambda e, a, k, p: e.fork(p, 2), BranchPruned, "'gone' was pruned"),
    "generate on a pruned branch": (lambda e, a, k, p: e.generate([a, p], 4), BranchPruned, "'gone' was pruned"),
    "append to a pruned branch": (lambda e, a, k, p: e.append(p, "x"), BranchPruned, "was pruned"),
    "prune twice": (lambda e, a, k, p: e.prune(p), BranchPruned, "was pruned"),
    "fork onto an existing name": (lambda e, a, k, p: e.fork(a, names=["x", "a"]), BranchExists, "'a' already exists"),
    "new branch with a taken name": (lambda e, a, k, p: e.new_branch("a", "x"), BranchExists, "already exists"),
    "fork n=0": (lambda e, a, k, p: e.fork(a, 0), ValueError, "n >= 1"),
    "fork with an empty name": (lambda e, a, k, p: e.fork(a, names=["x", ""]), ValueError, "non-empty string, got ''"),
    "fork with a non-string name": (lambda e, a, k, p: e.fork(a, names=["x", 3]), ValueError, "string, got 3"),
    "fork with an unhashable name": (lambda e, a, k, p: e.fork(a, names=["x", ["y"]]), ValueError, r"got \['y'\]"),
    "fork with a name twice": (lambda e, a, k, p: e.fork(a, names=["x", "y", "x"]), BranchExists, "'x' appears twice"),
    "fork with names as one string": (lambda e, a, k, p: e.fork(a, names="xy"), TypeError, "the string 'xy'"),
    "fork with n and other names": (lambda e, a, k, p: e.fork(a, 3, names=["x"]), ValueError, "n=3 and 1 names"),
    "generate zero tokens": (lambda e, a, k, p: e.generate([a], 0), ValueError, "positive int, got 0"),
    "generate negative tokens": (lambda e, a, k, p: e.generate([a], -5), ValueError, "positive int, got -5"),
    "generate a branch twice": (lambda e, a, k, p: e.generate([a, "a"], 4), ValueError, "listed twice"),
    "generate nothing": (lambda e, a, k, p: e.generate([], 4), ValueError, "no branches"),
    "logits of an empty branch": (lambda e, a, k, p: e.next_logits([e.new_branch("empty")]), EmptyBranch, "append a prompt"),
    "token id out of vocab": (lambda e, a, k, p: e.append(a, [1, 10**9]), ValueError, "not an int in"),
    "context overflow on append": (lambda e, a, k, p: e.append(a, [1] * 3000), ContextOverflow, "the model allows 2,048"),
    "context overflow on generate": (lambda e, a, k, p: e.generate(k, 2040), ContextOverflow, "needs 2,.*: add at most"),
    "context overflow on a new branch": (lambda e, a, k, p: e.new_branch("big", [1] * 2049), ContextOverflow, "2,049"),
    "pool too small for an append": (lambda e, a, k, p: e.append(a, [1] * 400), OutOfBlocks, "to branch 'a' needs"),
    "pool too small for generate": (lambda e, a, k, p: e.generate(k, 300), OutOfBlocks,
                                    "generating 300 tokens on 2 branches .branch 'a/0' alone, the others preempted"),
    "pool too small for a new branch": (lambda e, a, k, p: e.new_branch("big", [1] * 400), OutOfBlocks,
                                        "400 tokens to branch 'big' needs 100 free KV blocks, the pool has 57. Prune"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_call_raises_clearly_and_changes_nothing(case, populated):
    engine, a, kids, pruned = populated
    call, error, message = BAD_CALLS[case]
    before = engine_state(engine)
    with pytest.raises(error, match=message):
        call(engine, a, kids, pruned)
    if case == "logits of an empty branch":
        engine.prune("empty")  # the empty branch itself was a valid call
    assert engine_state(engine) == before
    engine.audit()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_an_interrupted_forward_undoes_its_appends(populated, monkeypatch):
    engine, a, kids, _ = populated
    before = engine_state(engine)
    calls = {"n": 0}
    real_forward = type(engine.model).forward

    def flaky_forward(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:  # the second chunk of a chunked prefill
            raise KeyboardInterrupt
        return real_forward(self, *args)

    monkeypatch.setattr(engine, "prefill_chunk_tokens", 8)
    monkeypatch.setattr(type(engine.model), "forward", flaky_forward)
    with pytest.raises(KeyboardInterrupt):
        engine.append(a, [5] * 20)
    assert engine_state(engine) == before
    engine.audit()


def test_an_interrupted_generate_keeps_completed_steps(populated, monkeypatch):
    engine, a, kids, _ = populated
    lengths = [len(k) for k in kids]
    interrupt_forward_call(monkeypatch, engine, 4)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        engine.generate(kids, 10, SamplingParams(temperature=0.0))
    assert [len(k) for k in kids] == [n + 3 for n in lengths]  # three whole steps landed, the fourth was undone
    assert [len(out) for out in interrupted.value.outputs] == [3] * len(kids)   # and it reports just those
    engine.audit()
    monkeypatch.undo()
    engine.generate(kids, 2, SamplingParams(temperature=0.0))  # and the engine carries on
    engine.audit()


def test_a_failure_between_planning_and_launching_a_step_undoes_the_planned_appends(populated, monkeypatch):
    """A decode step appends a pending token per branch before it samples; if sampling fails, those go."""
    import dendrite_nb.engine.decode as engine_module  # where the decode step samples

    engine, a, kids, _ = populated
    engine.generate(kids, 2, SamplingParams(temperature=0.0))
    lengths = [len(k) for k in kids]
    real_sample, calls = engine_module.sample, {"n": 0}

    def sample_failing_on_call_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sampler broke")
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", sample_failing_on_call_2)
    with pytest.raises(RuntimeError, match="sampler broke"):
        engine.generate(kids, 5, SamplingParams(temperature=0.0))
    engine.audit()   # among its checks: no node holds a pending token
    assert [len(k) for k in kids] == [n + 1 for n in lengths]   # step 1 landed; step 2's appends were undone
    monkeypatch.undo()
    engine.generate(kids, 1, SamplingParams(temperature=0.0))
    engine.audit()


# ---- checkpoint folders ---------------------------------------------------------------------------
def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_and_files(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nowhere")
    folder = copy_checkpoint(checkpoint(), tmp_path / "ck")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Engine.from_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        Engine.from_pretrained(folder)


def test_missing_and_unexpected_tensors_are_named(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint(), tmp_path / "ck")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight.*"
                                              r"unexpected tensor\(s\) model.layers.9.extra.weight"):
        Engine.from_pretrained(folder)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint(), tmp_path / "ck")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight .* has shape"):
        Engine.from_pretrained(folder)


def test_unsupported_model_type(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint(), tmp_path / "ck")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gemma"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="'gemma' is not supported.*llama, mistral, phi3, qwen2, qwen3"):
        Engine.from_pretrained(folder)


@pytest.mark.parametrize("shape, raw, message", [
    ("qwen2-gqa-tied", {"use_sliding_window": True, "sliding_window": 4096}, "every layer must attend to the whole"),
    ("qwen2-gqa-tied", {"layer_types": ["full_attention", "sliding_attention"]}, "every layer must attend"),
    ("phi3-gqa-untied", {"partial_rotary_factor": 0.75, "rope_parameters": None}, "partial_rotary_factor 0.75"),
    ("phi3-gqa-untied", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75"),
    ("phi3-gqa-untied", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                             "long_factor": [2.0] * 8}}, "rope type 'longrope' is not supported"),
])
def test_variants_the_engine_cannot_run_exactly_are_refused(checkpoint, tmp_path, shape, raw, message):
    folder = copy_checkpoint(checkpoint(shape), tmp_path / "ck")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **raw}))
    with pytest.raises(UnsupportedModel, match=message):
        Engine.from_pretrained(folder)


def test_missing_shard_is_named(checkpoint, tmp_path):
    from dendrite_nb.testing import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match=f"lists shard '{shard}', which is missing"):
        Engine.from_pretrained(folder)


def test_every_error_an_engine_call_raises_is_importable_from_the_package():
    """docs/reference.md promises the typed errors under `from dendrite_nb import ...`; the server's own (serve/)
    become HTTP errors and stay in their module."""
    import importlib
    import pkgutil

    import dendrite_nb

    for module in pkgutil.walk_packages(dendrite_nb.__path__, "dendrite_nb."):
        if not module.name.startswith(("dendrite_nb.serve", "dendrite_nb.__main__")):
            importlib.import_module(module.name)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    engine_errors = {cls for cls in subclasses(dendrite_nb.DendriteError)
                     if cls.__module__.startswith("dendrite_nb.") and not cls.__module__.startswith("dendrite_nb.serve")}
    assert {"TensorParallelError", "UnsupportedWeights"} <= {cls.__name__ for cls in engine_errors}
    missing = sorted(cls.__name__ for cls in engine_errors if cls.__name__ not in dendrite_nb.__all__)
    assert not missing, f"errors an engine call raises but the package does not export: {missing}"
    assert all(getattr(dendrite_nb, name) is cls for cls in engine_errors for name in [cls.__name__])
