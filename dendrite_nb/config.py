"""How an engine is built: one self-validating EngineConfig, and the parsers its fields share with the callers
that check options before any weight loads (from_pretrained, restore, the notebook's `%dendrite load`).

Every engine option is a field here, once: Engine(...) takes them as keyword arguments, a save file records
`saved_options()`, and whether a restore may change a field is a property of the field (`restore_override`), not a
second list kept elsewhere.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .attention import AUTO_ORDER
from .sampling import check_seed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache may also be fp8 (e4m3 with a float32 scale per token and KV head, kv/fp8.py); weights may not.
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}
ATTENTION_CHOICES = ("auto", *AUTO_ORDER)   # auto, then the backends fastest first


def parse_dtype(dtype: str | torch.dtype, choices: dict[str, torch.dtype] = DTYPES, what: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in choices.values():
        return dtype
    if dtype not in choices:
        raise ValueError(f"{what} {dtype!r} is not supported; choose one of {sorted(choices)}.")
    return choices[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    """The device an engine can run on: the CPU, or a CUDA GPU that this machine has."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device torch knows ({error}); use 'cpu', 'cuda' or "
                         f"'cuda:N'.") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the engine runs on 'cpu' or 'cuda', not {parsed.type!r}.")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: this machine has no CUDA GPU that torch can use (torch "
                             f"{torch.__version__}); use 'cpu'.")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}.")
    return parsed


def is_count(value: Any) -> bool:
    """A positive integer: an int, or any other Integral such as numpy's (callers make it an int before use). A
    bool is not a count, though Python makes it an int."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def check_switch(name: str, value: Any) -> None:
    """Raise ValueError unless an on/off option is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")


def check_pool_options(block_size: Any = 16, num_blocks: Any = None) -> tuple[int, int | None]:
    """Raise ValueError on a pool size torch could not allocate, before any weight is loaded; returns the sizes as
    plain ints."""
    if not is_count(block_size):
        raise ValueError(f"block_size must be a positive int (tokens per KV block), got {block_size!r}.")
    if num_blocks is not None and not is_count(num_blocks):
        raise ValueError(f"num_blocks must be a positive int (KV blocks in the pool) or None (fit the device), "
                         f"got {num_blocks!r}.")
    return int(block_size), None if num_blocks is None else int(num_blocks)


def _option(default: Any, restore_override: bool, saved: str | None, help: str):
    """A field of EngineConfig. saved: where a save file's manifest keeps it ("options"; "pool" for the fields
    the manifest keeps at its top level because the saved KV depends on them; None for how this machine runs it,
    which a save does not record). help: one line for users, as `%dendrite load` shows it."""
    return field(default=default, metadata={"restore_override": restore_override, "saved": saved, "help": help})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every option of an engine, checked when made (ValueError/TypeError naming the field and what to pass)."""

    device: str | torch.device = _option("cpu", True, "pool", "cpu, cuda or cuda:N")
    kv_dtype: str | torch.dtype | None = _option(None, False, "pool",
                                                 "dtype of the KV cache: fp8 (e4m3), bfloat16, ... (default: the weights')")
    block_size: int = _option(16, False, "pool", "tokens per KV block")
    num_blocks: int | None = _option(None, True, "pool", "KV pool size in blocks (default: fits the device)")
    attention: str = _option("auto", True, "options", ", ".join(ATTENTION_CHOICES))
    seed: int = _option(0, False, "options", "base of every branch's sampling seed")
    debug: bool = _option(False, True, "options", "poison freed KV blocks and check them on reuse")
    prefill_chunk_tokens: int | None = _option(None, False, "options",
                                               "tokens per prefill forward (default: the backend's, 512 or 4,096)")
    cuda_graphs: bool | None = _option(None, True, None, "replay decode steps as CUDA graphs (default: where they can)")
    prefix_reuse: bool = _option(True, True, "options", "prefill only the tokens of a prompt the tree does not hold")
    prefix_cache: bool = _option(False, True, "options",
                                 "keep what pruned branches held as cache for later prompts, evicted when needed")

    def __post_init__(self) -> None:
        block_size, num_blocks = check_pool_options(self.block_size, self.num_blocks)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "device", parse_device(self.device))
        if self.kv_dtype is not None:
            parse_dtype(self.kv_dtype, KV_DTYPES, "kv_dtype")
        check_seed(self.seed)
        if not isinstance(self.attention, str):
            raise TypeError(f"attention must be a backend name, one of {list(ATTENTION_CHOICES)}, got "
                            f"{type(self.attention).__name__}.")
        if not isinstance(self.debug, bool):
            raise ValueError(f"debug must be True or False, got {self.debug!r}.")
        if self.prefill_chunk_tokens is not None and not is_count(self.prefill_chunk_tokens):
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None (where they can run), got {self.cuda_graphs!r}.")
        for name in ("prefix_reuse", "prefix_cache"):
            check_switch(name, getattr(self, name))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def restore_overrides(cls) -> tuple[str, ...]:
        """The fields a restore may change: where the session runs, not what its saved KV means."""
        return tuple(f.name for f in fields(cls) if f.metadata["restore_override"])

    @classmethod
    def saved_option_names(cls) -> tuple[str, ...]:
        """The fields a save file keeps under `options` (the others it keeps at its top level)."""
        return tuple(f.name for f in fields(cls) if f.metadata["saved"] == "options")

    def saved_options(self) -> dict[str, Any]:
        """What a save file's manifest records under `options`."""
        return {name: getattr(self, name) for name in self.saved_option_names()}

    @classmethod
    def help(cls, name: str) -> str:
        """The field's one line for users, with its default when that is a value."""
        found = next(f for f in fields(cls) if f.name == name)
        text = found.metadata["help"]
        return text if found.default is None or "default" in text else f"{text} (default {found.default})"

    @classmethod
    def check_keywords(cls, options: dict[str, Any], allowed: tuple[str, ...] | None = None, call: str = "Engine") -> None:
        """Raise TypeError on an option this config does not have (or that `allowed` leaves out)."""
        allowed = cls.names() if allowed is None else allowed
        unknown = [key for key in options if key not in allowed]
        if unknown:
            raise TypeError(f"{call}() got unexpected options {unknown}; it takes {list(allowed)}.")
