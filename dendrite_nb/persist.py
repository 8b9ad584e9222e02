"""Save a whole session (tree, branches, sampling state, constraints, KV blocks) to one file and restore it.

The file is a safetensors file: the tensors (the KV blocks in use, compacted; their fp8 scales; each node's
last hidden state; each branch's sampling generator state) plus, in its metadata, a JSON manifest (format
version, the model's identity, the engine's options, the nodes and the branches) and a SHA-256 of the
manifest and of every tensor.

A write goes to a temporary file in the target's folder, `.<name>.dendrite-tmp-<host>-<pid>-<random>`, renamed
into place, so a crash leaves the old file whole. A save killed mid-way leaves its temporary behind; the next
save to the same target deletes those whose writer is gone (persist_write.py). Every failure to write is a
SaveFileError saying what to do, never a bare OSError.

The checksums catch accidents (a truncated file, flipped bits), not tampering: they sit in the file they check,
so whoever edits it can recompute them. Restoring never evaluates or unpickles anything (JSON and raw tensors
only), and checks every manifest field's type and range, and the tensors' shapes and dtypes, before it builds
anything (persist_schema.py): an altered or crafted file, another model, dtype or block size is a SaveFileError,
and no other engine is touched. A crafted file that passes can make a wrong session, but cannot run code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .chat import ChatState
from .config import EngineConfig, check_pool_options, parse_device
from .errors import CheckpointError, ConstraintError, DendriteError, SaveFileError
from .kv import BranchTree, KVPool, SavedNode, TreeDump
from .kv.tree import RECOMPUTE
from .paths import user_path
from .persist_schema import (FIX, FORMAT, VERSION, check_format, check_generators, check_manifest, check_model_config,
                             tensor_checksums)
from .persist_write import check_target, write_atomically, write_error


class SessionEngine(Protocol):
    """What save and restore use of an engine (dendrite_nb.engine.Engine, which calls them: this module does not
    import it). restore's `engine_type` is the class, whose from_pretrained and from_random build one (and
    check_pretrained and check_random check what they would build: check_restore)."""

    source: dict[str, Any] | None   # how it was built: a checkpoint folder, or a random-weight config and seed
    options: dict[str, Any]   # EngineConfig.saved_options()
    config: Any   # the model's ModelConfig
    model: torch.nn.Module
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    pool: KVPool
    branch_tree: BranchTree

    def constrain(self, branch: Any, spec: dict[str, Any]) -> Any: ...

    def audit(self) -> None: ...

    def close(self) -> None: ...


# Options a restore may change: they do not alter what the saved state means. tensor_parallel among them: a split
# engine saves its whole model's fingerprint and its KV gathered from every rank, as one process would.
FREE_OPTIONS = (*EngineConfig.restore_overrides(), "checkpoint", "tensor_parallel")


def weights_fingerprint(model: torch.nn.Module) -> str:
    """model_fingerprint of the whole model: a tensor-parallel rank's shard carries its whole model's."""
    return getattr(model, "whole_fingerprint", None) or model_fingerprint(model)


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, shape, dtype and a sample of its values (first and last 256)."""
    return fingerprint({name: parameter_sample(tensor) for name, tensor in model.state_dict().items()})


def parameter_sample(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.Tensor]:
    """What model_fingerprint reads of one whole parameter: its shape, dtype and first and last 256 values. A
    tensor-parallel rank takes it of each whole parameter before cutting its part (distributed/random_shard.py),
    so a split model's fingerprint is the whole model's."""
    flat = tensor.detach().reshape(-1)
    return tuple(tensor.shape), tensor.dtype, torch.cat([flat[:256], flat[-256:]]).to("cpu", torch.float32)


def fingerprint(samples: dict[str, tuple[tuple[int, ...], torch.dtype, torch.Tensor]]) -> str:
    """model_fingerprint of the parameters `samples` describes, by state_dict name."""
    digest = hashlib.sha256()
    for name, (shape, dtype, sample) in sorted(samples.items()):
        digest.update(f"{name}{shape}{dtype}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_sha(tensor: torch.Tensor) -> str:
    return _sha(tensor.contiguous().view(torch.uint8).numpy().tobytes())


# ---- save ----------------------------------------------------------------------------------------------
def save(engine: SessionEngine, path: str | Path) -> Path:
    target = user_path(path)
    check_target(target)
    if engine.source is None:
        raise SaveFileError("this engine was built around a model object, so a restore could not rebuild it; "
                            "save an engine made by Engine.from_pretrained or Engine.from_random.")
    tree, pool = engine.branch_tree, engine.pool
    dump, nodes = tree.dump()   # the same nodes in the same order: dump.nodes[i] is the data of nodes[i]
    used = sorted({block for saved in dump.nodes for block in saved.blocks})
    compact = {block: i for i, block in enumerate(used)}
    hidden_nodes = [i for i, node in enumerate(nodes) if node.last_hidden is not None]
    tensors: dict[str, torch.Tensor] = {}
    if used:
        kv_bytes, scales = pool.export_blocks(used)
        # The file holds the KV in the pool's dtype: [layers, 2, used, block, kv_heads, head_dim].
        tensors["kv"] = kv_bytes.view(pool.kv.dtype)
        if scales is not None:
            tensors["kv_scales"] = scales
    if hidden_nodes:
        tensors["hidden"] = torch.stack([nodes[i].last_hidden for i in hidden_nodes]).cpu()
    for i, node in enumerate(nodes):
        if node.swapped_blocks and isinstance(node.swapped, tuple):  # KV in host memory, as bytes (_preempt)
            tensors[f"preempted/{i}"] = node.swapped[0]
            if node.swapped[1] is not None:
                tensors[f"preempted_scales/{i}"] = node.swapped[1]
    branches = []
    for name, branch in tree.branches.items():
        if branch.generator is not None:
            tensors[f"generator/{len(branches)}"] = branch.generator.get_state()
        constraint = branch.constraint
        branches.append({
            "name": name, "node": dump.branches[name], "seed": branch.seed,
            "generator": branch.generator is not None,
            "constraint": None if constraint is None else constraint.spec(),
            "constraint_from": branch.constraint_from, "priority": branch.priority,
            "chat": None if branch.chat is None else branch.chat._asdict(),
        })
    manifest = {
        "format": FORMAT, "version": VERSION,
        "model": {"config": dataclasses.asdict(engine.config), "fingerprint": weights_fingerprint(engine.model)},
        "source": engine.source,
        "dtype": str(engine.dtype).removeprefix("torch."), "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "block_size": engine.pool.block_size, "options": engine.options, "next_node_id": dump.next_node_id,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "device": engine.device.type,
        "num_blocks": engine.pool.num_blocks,
        "nodes": [{"id": saved.id, "parent": saved.parent, "start": saved.start, "tokens": saved.tokens,
                   "blocks": [compact[b] for b in saved.blocks], "preempted": saved.preempted,
                   # JSON keys are strings; the index in the node's tokens.
                   "logprobs": {str(i): lp for i, lp in saved.logprobs.items()}} for saved in dump.nodes],
        "hidden_nodes": hidden_nodes,
        "branches": branches,
        "tensors": {name: _tensor_sha(tensor) for name, tensor in tensors.items()},
    }
    text = json.dumps(manifest)

    def write(temporary: str) -> None:
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, temporary,
                      metadata={"dendrite": text, "dendrite_sha256": _sha(text.encode())})
        except SafetensorError as error:   # safetensors' own I/O errors carry no errno
            raise SaveFileError(f"cannot save to {str(target)!r}: {error}; free some space or save somewhere "
                                f"else. Any file already there is unchanged.") from None

    try:
        mode = _mode_for(target)   # applied after save_file, which makes its file owner-only
    except OSError as error:
        raise write_error(target, error) from None
    write_atomically(target, write, mode)
    return target


def _mode_for(target: Path) -> int:
    """The permissions the saved file gets: an overwritten file's own, else what open() would give.

    mkstemp and safetensors' save_file make their file readable by its owner only (0600). Without this,
    a session saved on a shared workstation could not be restored by a colleague, unlike any other file
    the user writes there."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # the only way to read the umask is to set it; put it straight back
        os.umask(umask)
        return 0o666 & ~umask


# ---- restore -------------------------------------------------------------------------------------------
def read(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The manifest and tensors of a save file, its format and every checksum verified (not yet its fields:
    persist_schema.check_manifest). Raises SaveFileError."""
    source = user_path(path)
    try:
        found = source.is_file()
    except OSError as error:   # a name too long, a part of the path that cannot be searched
        raise SaveFileError(f"cannot read {str(source)!r}: {error.strerror or error}; check the path.") from None
    if not found:
        raise SaveFileError(f"no save file at {str(source)!r}.")
    try:
        with safe_open(str(source), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except Exception as error:  # safetensors reports a truncated or mangled header in several ways
        raise SaveFileError(f"{str(source)!r} is not a readable save file (truncated or corrupted: {error}).") from error
    text = metadata.get("dendrite")
    if text is None or metadata.get("dendrite_sha256") != _sha(text.encode()):
        raise SaveFileError(f"{str(source)!r} has no intact dendrite-nb manifest (checksum mismatch): the file "
                            f"is corrupted or was not written by Engine.save.")
    try:   # plain JSON: nothing in the file is evaluated
        manifest = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as error:
        raise SaveFileError(f"{str(source)!r} holds a manifest that is not plain JSON ({error}); {FIX}.") from None
    check_format(manifest, str(source))
    expected = tensor_checksums(manifest)
    if set(expected) != set(tensors):
        raise SaveFileError(f"{str(source)!r} lists tensors {sorted(expected)} but holds {sorted(tensors)}.")
    for name, tensor in tensors.items():
        if _tensor_sha(tensor) != expected[name]:
            raise SaveFileError(f"tensor {name!r} in {str(source)!r} fails its checksum: the file is corrupted.")
    return manifest, tensors


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys differ: json.loads would keep the last of a repeated key, unnoticed."""
    result = dict(pairs)
    if len(result) != len(pairs):
        repeated = next(key for key, _ in pairs if sum(other == key for other, _ in pairs) > 1)
        raise ValueError(f"the key {repeated!r} appears twice in one object")
    return result


def restore(engine_type: type[SessionEngine], path: str | Path, *,
            before_build: Callable[[], None] | None = None, **overrides: Any) -> SessionEngine:
    """A new engine holding the saved session. `overrides` may move it (device, num_blocks, attention,
    cuda_graphs, debug, checkpoint: where the weights now live); dtype, kv_dtype and block_size must match.
    Every field of the file is checked before anything is built; a failure after the engine is built closes it.
    before_build: called once every check that check_restore makes has passed, just before the engine is built
    (the notebook closes a tensor-parallel engine there, whose devices the new one needs), so the file is read
    once."""
    manifest, tensors, device, used = _checked(path, overrides)
    if before_build is not None:
        _check_build(engine_type, manifest, overrides, device, used)
        before_build()
    engine = _build(engine_type, manifest, overrides, device, used)
    try:
        if weights_fingerprint(engine.model) != manifest["model"]["fingerprint"]:
            raise SaveFileError("the model loaded for this session is not the one it was saved with (its weights "
                                "differ); restore with checkpoint= pointing at the model the session was saved from.")
        check_model_config(json.loads(json.dumps(dataclasses.asdict(engine.config))), manifest)
        if used > engine.pool.num_blocks:
            raise SaveFileError(f"the session holds {used:,} KV blocks, the pool has {engine.pool.num_blocks:,}; "
                                f"restore with num_blocks >= {used:,}.")
        _rebuild(engine, manifest, tensors, used)
        if "eos_token_ids" in manifest:   # files saved before it was kept have the model's own
            engine.eos_token_ids = manifest["eos_token_ids"]
    except BaseException:
        engine.close()   # its weights and pool go now, not when the garbage collector finds them
        raise
    return engine


def check_restore(engine_type: type[SessionEngine], path: str | Path, **overrides: Any) -> None:
    """Raise what restore(path, **overrides) would raise before it builds the engine: the file and every field of
    it, the overrides, and the engine it would build, checked as from_pretrained / from_random check theirs before
    loading (the checkpoint's config read, a tensor-parallel degree the model takes). Builds and starts nothing.
    What only building can find (the weight files' contents, the memory, the weights' fingerprint) stays
    restore's to find."""
    manifest, _, device, used = _checked(path, overrides)
    _check_build(engine_type, manifest, overrides, device, used)


def _check_build(engine_type: type[SessionEngine], manifest: dict[str, Any], overrides: dict[str, Any],
                 device: torch.device, used: int) -> None:
    """Raise what building the session's engine would raise before loading a weight (check_pretrained's or
    check_random's checks of its arguments)."""
    options, checkpoint, weights = _build_arguments(manifest, overrides, used)
    source = manifest["source"]
    try:
        if checkpoint is not None:
            engine_type.check_pretrained(checkpoint, device=device, dtype=manifest["dtype"], weights=weights,
                                         **options)
        else:
            engine_type.check_random(source["hf_config"], device=device, dtype=manifest["dtype"],
                                     weight_seed=source["weight_seed"], weights=weights, **options)
    except (DendriteError, ValueError, TypeError, LookupError, RuntimeError, OSError) as error:
        raise _cannot_rebuild(error, checkpoint, overrides) from error


def _checked(path: str | Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                                                    torch.device, int]:
    """(manifest, tensors, device, KV blocks used) of the save file at `path`, every check restore makes before
    it builds done."""
    manifest, tensors = read(path)
    unknown = [key for key in overrides if key not in FREE_OPTIONS + ("dtype", "kv_dtype", "block_size")]
    if unknown:
        raise TypeError(f"restore() got unexpected options {unknown}; it takes {list(FREE_OPTIONS)}.")
    check_manifest(manifest, tensors)
    for key in ("dtype", "kv_dtype", "block_size"):
        if key in overrides and str(overrides[key]).removeprefix("torch.") != str(manifest[key]):
            raise SaveFileError(f"the session was saved with {key}={manifest[key]}, not {overrides[key]}; its KV "
                                f"cache is only valid for the same {key}.")
    used = tensors["kv"].shape[2] if "kv" in tensors else 0
    if overrides.get("num_blocks") is not None:
        check_pool_options(num_blocks=overrides["num_blocks"])
        if overrides["num_blocks"] < used:
            raise SaveFileError(f"the session holds {used:,} KV blocks; restore with num_blocks >= {used:,}.")
    if overrides.get("device"):
        device = parse_device(overrides["device"])
    else:   # where it was saved from
        try:
            device = parse_device(manifest["device"])
        except ValueError as error:
            raise SaveFileError(f"the session was saved on {manifest['device']}: {error} Restore it with "
                                f"device='cpu' (or another device this machine has).") from None
    check_generators(manifest, tensors, device)
    return manifest, tensors, device, used


def _build_arguments(manifest: dict[str, Any], overrides: dict[str, Any],
                     used: int) -> tuple[dict[str, Any], str | None, str | None]:
    """(the engine's options, the checkpoint it loads or None for random weights, its weights format or None)."""
    options = {**manifest["options"], "block_size": manifest["block_size"], "kv_dtype": manifest["kv_dtype"],
               "num_blocks": max(manifest["num_blocks"], used)}
    options.update({k: v for k, v in overrides.items() if k in FREE_OPTIONS and k not in ("device", "checkpoint")})
    checkpoint = overrides.get("checkpoint") or manifest["source"].get("checkpoint")
    return options, checkpoint, manifest["source"].get("weights")   # the quantized format the session ran, or None


def _cannot_rebuild(error: BaseException, checkpoint: str | None, overrides: dict[str, Any]) -> SaveFileError:
    """The error of building the session's engine, saying which arguments it was built with: a bad override is
    the caller's, not the file's."""
    given = {key: value for key, value in overrides.items() if key != "checkpoint"}
    with_overrides = f" with the overrides {given}" if given else ""
    moved = (" If the model has moved, restore with checkpoint= pointing at it."
             if checkpoint is not None and isinstance(error, (CheckpointError, OSError)) else "")
    return SaveFileError(f"cannot rebuild the engine this session was saved from{with_overrides}: {error}{moved}")


def _build(engine_type: type[SessionEngine], manifest: dict[str, Any], overrides: dict[str, Any],
           device: torch.device, used: int) -> SessionEngine:
    """The engine the session was saved from, empty: its model rebuilt from the checkpoint folder (or the
    random-weight config) and its options. A checked manifest leaves only the file system and memory to fail."""
    options, checkpoint, weights = _build_arguments(manifest, overrides, used)
    source = manifest["source"]
    try:
        if checkpoint is not None:
            return engine_type.from_pretrained(checkpoint, device=device, dtype=manifest["dtype"], weights=weights,
                                               **options)
        return engine_type.from_random(source["hf_config"], device=device, dtype=manifest["dtype"],
                                       weight_seed=source["weight_seed"], weights=weights, **options)
    except (DendriteError, ValueError, TypeError, LookupError, RuntimeError, OSError, MemoryError) as error:
        raise _cannot_rebuild(error, checkpoint, overrides) from error


def _rebuild(engine: SessionEngine, manifest: dict[str, Any], tensors: dict[str, torch.Tensor], used: int) -> None:
    tree, pool = engine.branch_tree, engine.pool
    blocks = pool.allocator.allocate(used) if used else []
    if used:
        pool.import_blocks(blocks, (tensors["kv"], tensors.get("kv_scales")))
    dump = TreeDump(
        nodes=[SavedNode(id=saved["id"], parent=saved["parent"], start=saved["start"], tokens=saved["tokens"],
                         blocks=[blocks[b] for b in saved["blocks"]], preempted=saved["preempted"],
                         logprobs={int(i): lp for i, lp in saved.get("logprobs", {}).items()})
               for saved in manifest["nodes"]],
        branches={saved["name"]: saved["node"] for saved in manifest["branches"]},
        next_node_id=manifest["next_node_id"])
    try:   # check_manifest refuses whatever would fail these; a failure here is a gap in it, still the file's fault
        nodes = tree.load(dump, {saved["name"]: {"seed": saved["seed"]} for saved in manifest["branches"]})
    except ValueError as error:
        raise SaveFileError(f"the save file does not make a consistent session ({error}); {FIX}.") from None
    for number, saved in enumerate(manifest["nodes"]):
        if saved["preempted"]:
            nodes[number].swapped = ((tensors[f"preempted/{number}"], tensors.get(f"preempted_scales/{number}"))
                                     if f"preempted/{number}" in tensors else RECOMPUTE)
    for row, node_index in enumerate(manifest["hidden_nodes"]):
        nodes[node_index].last_hidden = tensors["hidden"][row].to(engine.device)
    for number, saved in enumerate(manifest["branches"]):
        branch = tree.branches[saved["name"]]
        branch.priority = float(saved["priority"])
        if saved.get("chat") is not None:   # files saved before chat() existed have no "chat"
            chat = saved["chat"]
            branch.chat = ChatState(tuple(map(tuple, chat["messages"])), chat["mark"], chat["generation_prompt"])
        if saved["generator"]:
            branch.generator = torch.Generator(device=engine.device)
            branch.generator.set_state(tensors[f"generator/{number}"])
        if saved["constraint"] is not None:
            _constrain(engine, branch, saved["constraint"], saved["constraint_from"])
    try:
        engine.audit()
    except AssertionError as error:
        raise SaveFileError(f"the save file does not make a consistent session ({error}); {FIX}.") from None


def _constrain(engine: SessionEngine, branch: Any, spec: dict[str, Any], since: int) -> None:
    """Put the branch back under its constraint, at the grammar position its tokens since `since` reach."""
    try:
        engine.constrain(branch, spec)
    except ConstraintError as error:   # a grammar this model's tokenizer cannot start
        raise SaveFileError(f"branch {branch.name!r}'s saved constraint cannot be restored: {error}") from None
    if not branch.matcher.consume_tokens(branch.tokens[since:]) or branch.matcher.is_error():
        raise SaveFileError(f"branch {branch.name!r}'s tokens after position {since:,} are not ones its saved "
                            f"constraint allows ({branch.matcher.get_error()}); {FIX}.")
    branch.constraint_from = since
