"""Every field of a save file's manifest, checked for type, range and consistency before restore builds anything.

The manifest is JSON read by json.loads and nothing else, and the tensors beside it are raw arrays read by
safetensors: nothing in a save file is evaluated or unpickled. The manifest's SHA-256 sits in the same file, so
it catches accidents (truncation, flipped bits) but not edits: whoever edits the file can recompute it. Hence
this module: a missing or unknown key, a value of the wrong type, an int out of range, a node whose parent is not
an earlier node or whose start is not its parent's end, block indexes outside the saved KV or in the wrong number
for a node's tokens, a token id outside the vocabulary, a branch name that new_branch would refuse, a tensor whose
shape or dtype is not the one the manifest implies: each is a SaveFileError naming the field. What passes builds a
tree that Engine.audit() accepts. A crafted file can still hold a session nobody ran (KV that does not belong to its
tokens), but it cannot run code, and restoring it touches no other engine.

Unknown keys are refused, not ignored: a format that grows a key is a new VERSION, so an unknown key means a file
this code does not understand.
"""
from __future__ import annotations

import math
import reprlib
from collections import Counter
from typing import Any, NoReturn

import torch

from .config import DTYPES, KV_DTYPES, EngineConfig
from .constraints import CONSTRAINT_KINDS, JSON_SCHEMA_OPTIONS, parse_constraint
from .errors import DendriteError, SaveFileError
from .kv.allocator import BlockAllocator
from .kv.tree import BranchTree
from .model.config import ModelConfig
from .model.quantized_linear import WEIGHT_FORMATS
from .sampling import SEED_LIMIT

FORMAT = "dendrite-nb session"
VERSION = 1
FIX = "the file was edited or damaged in a way its checksum cannot catch; restore another copy of the session"
TOP_KEYS = ("format", "version", "model", "source", "dtype", "kv_dtype", "block_size", "options", "next_node_id",
            "device", "num_blocks", "nodes", "hidden_nodes", "branches", "tensors")
# Keys a file of this version may lack: files saved before they existed (eos_token_ids: the engine's as the session
# left them; absent, the model's own).
OPTIONAL_TOP_KEYS = ("eos_token_ids",)
# The model's dimensions that the tree and the tensors are checked against before the model is built; after it is
# built, every config field the file holds must equal the model's own (check_model_config).
DIMS = ("vocab_size", "hidden_size", "num_layers", "num_kv_heads", "head_dim", "max_position_embeddings")
# Ints past this are no count, index or id a session holds; torch indexes tensors with int64.
MAX_INT = 2**62
# Engine options a save holds that restore passes to Engine(...) itself, not through `options`.
POOL_OPTIONS = ("device", "kv_dtype", "block_size", "num_blocks")
_shown = reprlib.Repr()
_shown.maxstring, _shown.maxother, _shown.maxlist, _shown.maxdict = 60, 60, 8, 6


# ---- primitives: each returns the value it checked, or raises SaveFileError naming the field -------------------
def _bad(where: str, expected: str, got: Any) -> NoReturn:
    shown = "null" if got is None else f"{type(got).__name__} {_shown.repr(got)}"
    raise SaveFileError(f"save file field {where} should be {expected}, but is {shown}; {FIX}.")


def _keys(value: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        _bad(where, "a JSON object", value)
    missing = [key for key in required if key not in value]
    if missing:
        raise SaveFileError(f"save file field {where} lacks the key {missing[0]!r}; {FIX}.")
    unknown = [key for key in value if key not in required and key not in optional]
    if unknown:
        raise SaveFileError(f"save file field {where} holds the key {_shown.repr(unknown[0])}, which format "
                            f"version {VERSION} does not have (it has {', '.join(required + optional)}); {FIX}.")
    return value


def _int(value: Any, where: str, low: int, high: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _bad(where, f"an int from {low:,} to {high:,}" if high < MAX_INT else f"an int >= {low:,}", value)
    return value


def _ints(value: Any, where: str, low: int, high: int) -> list[int]:
    """A list of ints in [low, high], checked in C-speed passes: a node may hold 100,000 tokens."""
    if not isinstance(value, list):
        _bad(where, "a list", value)
    if value and (not all(type(item) is int for item in value) or min(value) < low or max(value) > high):
        bad = next(item for item in value if type(item) is not int or not low <= item <= high)
        _bad(f"{where} (an item)", f"an int from {low:,} to {high:,}", bad)
    return value


def _text(value: Any, where: str, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        _bad(where, "a string" if empty else "a non-empty string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON's \ud800 escapes decode to lone surrogates, which no text can hold
        _bad(where, "text without lone surrogates", value)
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        _bad(where, "true or false", value)
    return value


def _number(value: Any, where: str, finite: bool) -> float:
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:   # an int past float's range
            number = math.inf
        if not finite or math.isfinite(number):
            return number
    _bad(where, "a finite number" if finite else "a number", value)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        _bad(where, "a list", value)
    return value


# ---- the manifest, part by part -------------------------------------------------------------------------------
def check_format(manifest: Any, source: str) -> None:
    """The file is this program's format and version (before anything else is read from it)."""
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT or type(version) is not int
            or version != VERSION):
        named = manifest if not isinstance(manifest, dict) else (manifest.get("format"), version)
        raise SaveFileError(f"{source!r} is not a {FORMAT!r} version {VERSION} file (it holds "
                            f"{_shown.repr(named)}); save it again with this dendrite-nb, or restore it with the "
                            f"version that wrote it.")


def tensor_checksums(manifest: dict[str, Any]) -> dict[str, str]:
    sums = manifest.get("tensors")
    if not isinstance(sums, dict) or not all(isinstance(value, str) for value in sums.values()):
        _bad("tensors", "an object of tensor name to SHA-256", sums)
    return sums


def check_manifest(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Raise SaveFileError unless every field is of its type and range and they agree with each other and with
    the tensors (whose checksums read() verified)."""
    _keys(manifest, "(the manifest)", TOP_KEYS, OPTIONAL_TOP_KEYS)
    dims = _model(manifest["model"])
    if "eos_token_ids" in manifest:
        eos = _ints(manifest["eos_token_ids"], "eos_token_ids", 0, dims["vocab_size"] - 1)
        if len(set(eos)) != len(eos):
            _bad("eos_token_ids", "token ids listed once each", eos)
    _source(manifest["source"], dims)
    dtype = _choice(manifest["dtype"], "dtype", DTYPES)
    kv_dtype = _choice(manifest["kv_dtype"], "kv_dtype", KV_DTYPES)
    block_size = _int(manifest["block_size"], "block_size", 1, 2**20)
    _options(manifest["options"])
    _choice(manifest["device"], "device", {"cpu": None, "cuda": None})
    _int(manifest["num_blocks"], "num_blocks", 1, 2**31 - 1)
    nodes = _nodes(manifest["nodes"], dims, block_size)
    ids = [node["id"] for node in nodes]
    _int(manifest["next_node_id"], "next_node_id", max(ids, default=0) + 1)
    hidden = _ints(manifest["hidden_nodes"], "hidden_nodes", 0, len(nodes) - 1)
    if len(set(hidden)) != len(hidden):
        _bad("hidden_nodes", "node indexes listed once each", hidden)
    branches = _branches(manifest["branches"], nodes, has_tokenizer="checkpoint" in manifest["source"])
    _reachable(nodes, branches)
    _tensors(tensors, manifest, dims, dtype, kv_dtype, block_size)


def _choice(value: Any, where: str, choices: dict[str, Any]) -> Any:
    if not isinstance(value, str) or value not in choices:
        _bad(where, f"one of {sorted(choices)}", value)
    return choices[value]


def _model(model: Any) -> dict[str, int]:
    _keys(model, "model", ("config", "fingerprint"))
    fingerprint = model["fingerprint"]
    if not isinstance(fingerprint, str) or len(fingerprint) != 64 or fingerprint.strip("0123456789abcdef"):
        _bad("model.fingerprint", "a SHA-256 in hex", fingerprint)
    config = model["config"]
    if not isinstance(config, dict):
        _bad("model.config", "a JSON object", config)
    missing = [key for key in DIMS if key not in config]
    if missing:
        raise SaveFileError(f"save file field model.config lacks the key {missing[0]!r}; {FIX}.")
    return {key: _int(config[key], f"model.config.{key}", 1, 2**31 - 1) for key in DIMS}


def _source(source: Any, dims: dict[str, int]) -> None:
    if isinstance(source, dict) and "weights" in source and source["weights"] not in WEIGHT_FORMATS:
        _bad("source.weights", f"one of {', '.join(WEIGHT_FORMATS)}", source["weights"])
    if isinstance(source, dict) and "checkpoint" in source:
        path = _text(_keys(source, "source", ("checkpoint",), ("weights",))["checkpoint"], "source.checkpoint",
                     empty=False)
        if "\x00" in path:
            _bad("source.checkpoint", "a path (no NUL character)", path)
        return
    _keys(source, "source", ("hf_config", "weight_seed"), ("weights",))
    _int(source["weight_seed"], "source.weight_seed", -(2**63), SEED_LIMIT - 1)
    hf_config = source["hf_config"]
    if not isinstance(hf_config, dict):
        _bad("source.hf_config", "a JSON object", hf_config)
    try:
        config = ModelConfig.from_hf(hf_config)
    except (DendriteError, LookupError, TypeError, ValueError, AttributeError) as error:
        raise SaveFileError(f"save file field source.hf_config is not a model config this dendrite-nb can build "
                            f"({error}); {FIX}.") from None
    for key, value in dims.items():
        if getattr(config, key) != value:
            _bad(f"source.hf_config (its {key})", f"{value}, as model.config says", getattr(config, key))


def _options(options: Any) -> None:
    if not isinstance(options, dict):
        _bad("options", "a JSON object", options)
    # Options a later engine records are passed on to Engine(), which checks them; anything else is unknown.
    known = [name for name in EngineConfig.names() if name not in POOL_OPTIONS]
    _keys(options, "options", (), tuple(known))
    checks = {"attention": lambda value, where: _text(value, where, empty=False),
              "seed": lambda value, where: _int(value, where, -(2**63), SEED_LIMIT - 1),
              "debug": _bool,
              "prefill_chunk_tokens": lambda value, where: value is None or _int(value, where, 1, 2**31 - 1),
              "cuda_graphs": lambda value, where: value is None or _bool(value, where),
              "prefix_reuse": _bool, "prefix_cache": _bool}
    for name, value in options.items():
        if name in checks:
            checks[name](value, f"options.{name}")


def _nodes(saved: Any, dims: dict[str, int], block_size: int) -> list[dict[str, Any]]:
    """Nodes in the order save() writes them, each after its parent: a parent index that is not an earlier
    node (out of range, itself, a later node, so any cycle) is refused. Each saved KV block is held once."""
    ends: list[int] = []
    ids: set[int] = set()
    held: Counter[int] = Counter()
    for index, node in enumerate(_list(saved, "nodes")):
        where = f"nodes[{index}]"
        _keys(node, where, ("id", "parent", "start", "tokens", "blocks", "preempted"), ("logprobs",))
        node_id = _int(node["id"], f"{where}.id", 1)
        if node_id in ids:
            _bad(f"{where}.id", "an id no other node has", node_id)
        ids.add(node_id)
        parent = _int(node["parent"], f"{where}.parent", -1, index - 1)
        parent_end = ends[parent] if parent >= 0 else 0
        if type(node["start"]) is not int or node["start"] != parent_end:
            _bad(f"{where}.start", f"{parent_end:,}, the end of its parent", node["start"])
        tokens = _ints(node["tokens"], f"{where}.tokens", 0, dims["vocab_size"] - 1)
        end = parent_end + len(tokens)
        if end > dims["max_position_embeddings"]:
            _bad(f"{where}.tokens", f"at most {dims['max_position_embeddings'] - parent_end:,} tokens (the "
                                    f"model's context)", len(tokens))
        blocks = _ints(node["blocks"], f"{where}.blocks", 0, 2**31 - 1)
        preempted = _int(node["preempted"], f"{where}.preempted", 0)
        spans = -(-end // block_size) - parent_end // block_size
        if len(blocks) + preempted != spans or (preempted and blocks):
            raise SaveFileError(f"save file field {where}: {len(tokens):,} tokens from position {parent_end:,} "
                                f"take {spans:,} blocks of {block_size}, held or preempted (not both), but it lists "
                                f"{len(blocks):,} held and {preempted:,} preempted; {FIX}.")
        held.update(blocks)
        _logprobs(node.get("logprobs", {}), f"{where}.logprobs", len(tokens))
        ends.append(end)
    shared = [block for block, count in held.items() if count > 1]
    past = sorted(block for block in held if block >= len(held))
    if shared or past:   # the saved KV holds exactly the blocks in use, compacted to 0..n-1, one node each
        what = (f"block {shared[0]} is held by {held[shared[0]]} nodes" if shared
                else f"they name block {past[-1]}, past the {len(held)} blocks they hold")
        raise SaveFileError(f"save file field nodes[*].blocks should hold each of the saved KV blocks 0 to "
                            f"{len(held) - 1} once, but {what}; {FIX}.")
    return [{**node, "end": end} for node, end in zip(saved, ends)]


def _logprobs(logprobs: Any, where: str, num_tokens: int) -> None:
    if not isinstance(logprobs, dict):
        _bad(where, "a JSON object", logprobs)
    for key, value in logprobs.items():
        if not (len(key) <= 19 and key.isascii() and key.isdigit() and str(int(key)) == key
                and int(key) < num_tokens):
            _bad(f"{where} (a key)", f"a token index from 0 to {num_tokens - 1} in decimal", key)
        _number(value, f"{where}[{key}]", finite=False)


def _branches(saved: Any, nodes: list[dict[str, Any]], has_tokenizer: bool) -> list[dict[str, Any]]:
    branches = _list(saved, "branches")
    for number, branch in enumerate(branches):
        where = f"branches[{number}]"
        _keys(branch, where, ("name", "node", "seed", "generator", "constraint", "constraint_from", "priority"),
              ("chat",))   # files saved before chat() existed have no "chat"
        _text(branch["name"], f"{where}.name", empty=False)
        node = _int(branch["node"], f"{where}.node", -1, len(nodes) - 1)
        length = nodes[node]["end"] if node >= 0 else 0
        _int(branch["seed"], f"{where}.seed", 0, SEED_LIMIT - 1)
        _bool(branch["generator"], f"{where}.generator")
        _constraint(branch["constraint"], f"{where}.constraint", has_tokenizer)
        _int(branch["constraint_from"], f"{where}.constraint_from", 0, length)
        _number(branch["priority"], f"{where}.priority", finite=True)
        _chat(branch.get("chat"), f"{where}.chat", length)
    try:   # the rule every call that makes a branch follows: a non-empty string, unused, given once
        BranchTree(BlockAllocator(1), 1).check_new_names([branch["name"] for branch in branches])
    except ValueError as error:
        raise SaveFileError(f"save file field branches: {str(error).rstrip('.')}; {FIX}.") from None
    return branches


def _constraint(spec: Any, where: str, has_tokenizer: bool) -> None:
    if spec is None:
        return
    # a file written before json_schema options existed holds one key; parse_constraint checks the options
    if not isinstance(spec, dict) or sum(key in CONSTRAINT_KINDS for key in spec) != 1:
        _bad(where, f"null or an object with one key of {', '.join(CONSTRAINT_KINDS)} (and a json_schema's "
                    f"options {', '.join(JSON_SCHEMA_OPTIONS)})", spec)
    if not has_tokenizer:
        raise SaveFileError(f"save file field {where} holds a constraint, but the session's engine has random "
                            f"weights and no tokenizer to constrain with; {FIX}.")
    try:
        parse_constraint(spec)
    except (DendriteError, ValueError, TypeError, RecursionError) as error:
        raise SaveFileError(f"save file field {where} is not a valid constraint ({error}); {FIX}.") from None


def _chat(chat: Any, where: str, length: int) -> None:
    if chat is None:
        return
    _keys(chat, where, ("messages", "mark", "generation_prompt"))
    for index, message in enumerate(_list(chat["messages"], f"{where}.messages")):
        if not isinstance(message, list) or len(message) != 2:
            _bad(f"{where}.messages[{index}]", "a [role, content] pair", message)
        _text(message[0], f"{where}.messages[{index}] (its role)", empty=False)
        _text(message[1], f"{where}.messages[{index}] (its content)")
    _int(chat["mark"], f"{where}.mark", 0, length)
    _bool(chat["generation_prompt"], f"{where}.generation_prompt")


def _reachable(nodes: list[dict[str, Any]], branches: list[dict[str, Any]]) -> None:
    """Each node is a parent or a branch's node (else nothing could reach it); a preempted one has no child (it
    is resumed before anything grows from it; forks of its branch may read it too)."""
    children = Counter(node["parent"] for node in nodes)
    readers = Counter(branch["node"] for branch in branches)
    for index, node in enumerate(nodes):
        if node["preempted"] and children[index]:
            raise SaveFileError(f"save file field nodes[{index}] is preempted, which only a node with no children "
                                f"can be, but it has {children[index]} children; {FIX}.")
        if not children[index] and not readers[index]:
            raise SaveFileError(f"save file field nodes[{index}] is no branch's node and no node's parent, so nothing "
                                f"reaches it; {FIX}.")


def _tensors(tensors: dict[str, torch.Tensor], manifest: dict[str, Any], dims: dict[str, int], dtype: torch.dtype,
             kv_dtype: torch.dtype, block_size: int) -> None:
    """The tensors the manifest implies, each of its shape and dtype, and no others."""
    per_block = (dims["num_layers"], 2)
    head = (block_size, dims["num_kv_heads"])
    fp8 = kv_dtype == KV_DTYPES["fp8"]
    used = sum(len(node["blocks"]) for node in manifest["nodes"])
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if used:
        wanted["kv"] = (per_block + (used,) + head + (dims["head_dim"],), kv_dtype)
        if fp8:
            wanted["kv_scales"] = (per_block + (used,) + head, torch.float32)
    if manifest["hidden_nodes"]:
        wanted["hidden"] = ((len(manifest["hidden_nodes"]), dims["hidden_size"]), dtype)
    optional = {}
    for index, node in enumerate(manifest["nodes"]):
        if node["preempted"]:   # held in host memory as bytes, or (when absent) dropped to be recomputed
            count = (node["preempted"],)
            optional[f"preempted/{index}"] = (per_block + count + head + (dims["head_dim"] * kv_dtype.itemsize,),
                                              torch.uint8)
            if fp8 and f"preempted/{index}" in tensors:
                wanted[f"preempted_scales/{index}"] = (per_block + count + head, torch.float32)
    for number, branch in enumerate(manifest["branches"]):
        if branch["generator"]:
            wanted[f"generator/{number}"] = (None, torch.uint8)   # its size depends on the device (check_generators)
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise SaveFileError(f"the save file lacks the tensor {missing[0]!r} its manifest implies; {FIX}.")
    for name, tensor in tensors.items():
        shape, kind = wanted.get(name) or optional.get(name) or (None, None)
        if kind is None:
            raise SaveFileError(f"the save file holds a tensor {_shown.repr(name)} its manifest does not explain; "
                                f"{FIX}.")
        if tensor.dtype != kind or (tuple(tensor.shape) != shape if shape is not None else tensor.dim() != 1):
            expected = f"{list(shape) if shape is not None else '[n]'} {str(kind).removeprefix('torch.')}"
            raise SaveFileError(f"tensor {name!r} in the save file is {list(tensor.shape)} "
                                f"{str(tensor.dtype).removeprefix('torch.')}, the manifest implies {expected}; {FIX}.")


def check_generators(manifest: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Each saved sampling-generator state is the size a generator on `device` keeps."""
    size = torch.Generator(device=device).get_state().numel()
    for number, branch in enumerate(manifest["branches"]):
        state = tensors.get(f"generator/{number}")
        if branch["generator"] and state.numel() != size:
            raise SaveFileError(f"branch {branch['name']!r}'s sampling-generator state holds {state.numel():,} bytes; "
                                f"a {device.type} generator keeps {size:,} (a state saved on another kind of device "
                                f"cannot move: restore on the device it was saved from, or the file is damaged).")


def check_model_config(built: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Every config field the file records equals the rebuilt model's (fields of other versions are skipped)."""
    saved = manifest["model"]["config"]
    differ = [key for key in saved.keys() & built.keys() if saved[key] != built[key]]
    if differ:
        key = sorted(differ)[0]
        raise SaveFileError(f"the model rebuilt for this session has {key}={built[key]!r}, the save file says "
                            f"{_shown.repr(saved[key])}; restore with checkpoint= pointing at the model the session "
                            f"was saved from.")
