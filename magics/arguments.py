"""Reading a magic's line: shell-style argument splitting, the sampling options several magics share, and the
one place where the engine's refusals become UsageErrors (a one-line message, no traceback)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument
from IPython.utils.process import arg_split

from dendrite_nb import DendriteError, SamplingParams
from dendrite_nb.config import EngineConfig


@contextmanager
def user_errors() -> Iterator[None]:
    """The engine's refusals of a request become UsageErrors; its bugs keep their tracebacks."""
    try:
        yield
    except (DendriteError, ValueError, LookupError) as error:
        raise UsageError(str(error)) from None


def parse_arguments(magic_func, line: str):
    """The magic's arguments split as a shell would: quotes group a value and are not part of it (`--stop "."`
    stops at a period; a quoted path may hold spaces). IPython's own parse_argstring keeps the quotes."""
    try:
        argv = arg_split(line, posix=True)
    except ValueError as error:   # an unclosed quote
        raise UsageError(f"cannot read the arguments {line!r}: {error}; close the quote.") from None
    return magic_func.parser.parse_args(argv)


def no_arguments(name: str, line: str) -> None:
    """Refuse a line given to a magic that takes none (`%tree`, `%blocks`, ...)."""
    if line.strip():
        raise UsageError(f"%{name} takes no arguments, got {line.strip()!r}.")


def sampling_arguments(func):
    """Adds the sampling options (SAMPLING_OPTIONS) to a magic's arguments."""
    for decorator in reversed([
        argument("--temperature", "-t", type=float, default=1.0, help="softmax temperature; 0 is greedy (default 1.0)"),
        argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)"),
        argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass (1: off)"),
        argument("--min-p", type=float, default=0.0,
                 help="drop tokens under this fraction of the most likely token's probability (0: off)"),
        argument("--repetition-penalty", type=float, default=1.0, help="divide logits of tokens already seen (HF style)"),
        argument("--seed", type=int, default=None, help="reseed each branch's sampler (derived per branch name)"),
        argument("--stop", action="append", default=[], help="stop a branch when its new text contains this (repeatable)"),
        argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token"),
    ]):
        func = decorator(func)
    return func


def engine_option_arguments(*names: str):
    """Adds engine options (fields of EngineConfig, where they are defined once) as --kebab-case arguments whose
    default None leaves the engine's own default; engine_options(args) collects those the line set."""
    types = {"block_size": int, "num_blocks": int, "seed": int, "prefill_chunk_tokens": int}

    def decorate(func):
        for name in reversed(names):
            func = argument(f"--{name.replace('_', '-')}", type=types.get(name, str), default=None,
                            dest=f"engine_{name}", metavar=name.upper(), help=EngineConfig.help(name))(func)
        return func
    return decorate


def engine_options(args) -> dict:
    """The engine options a line set, by EngineConfig field (see engine_option_arguments)."""
    return {name.removeprefix("engine_"): value for name, value in vars(args).items()
            if name.startswith("engine_") and value is not None}


# What sampling_arguments adds to a magic's arguments, by destination.
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos")


def sampling_options_set(magic_func, args) -> list[str]:
    """The sampling options the line set (those away from their defaults), as the user spells them."""
    return [f"--{dest.replace('_', '-')}" for dest in SAMPLING_OPTIONS
            if getattr(args, dest) != magic_func.parser.get_default(dest)]


def sampling_from(args) -> SamplingParams:
    with user_errors():
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, stop=tuple(args.stop), seed=args.seed,
                              ignore_eos=args.ignore_eos)
