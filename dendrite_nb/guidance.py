"""Constrained decoding with llguidance: one LLTokenizer per model, one LLMatcher per constrained branch.

Each decode step, the rows of constrained branches get a token bitmask applied to their logits before
sampling, and the sampled token is consumed by the branch's matcher at once. The bitmask for the next
step is then filled by llguidance's Rust worker threads (in parallel across rows, from a Python worker
thread) while the model's forward pass runs, so the mask costs little wall time. Batches with no
constrained branch never reach this module.
A matcher is plain CPU state: a fork deep-copies it so siblings continue the same grammar position
independently, and a prune drops it with the branch.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .constraints import Constraint
from .errors import ConstraintError
from .grammar_cache import StartedGrammars


def first_token_error(matcher) -> str | None:
    """The error a matcher hits on its first token, tried on a copy with the first token its mask allows, or None.
    Some grammars compile and fail only when their lexer first runs (a regex a{1000000}: "too many expressions
    constructed"); found here, they are refused before any branch is touched, not after a step."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    allowed = words.nonzero()
    if len(allowed) == 0:   # nothing allowed at the start: generate refuses such a grammar as complete
        return None
    word = int(allowed[0])
    bits = int(words[word]) & 0xFFFF_FFFF
    probe = matcher.deep_copy()
    probe.consume_token(word * 32 + (bits & -bits).bit_length() - 1)   # the lowest allowed token
    return probe.get_error() if probe.is_error() else None


class Guidance:
    """The engine's llguidance state: built on first use, so unconstrained engines never load it."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        import llguidance
        import llguidance.hf

        if hf_tokenizer is None:
            raise ConstraintError("constraints need a tokenizer; this engine has none (built from random weights).")
        eos = sorted(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos[0] if eos else None)
        self.executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) - 1)))
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dendrite-mask")
        # check_generate starts a call's grammar and its generate attaches copies of the same; a grammar seen
        # before (an earlier call's, a re-run cell's) is not compiled again either.
        self._started = StartedGrammars(self._compile)

    def matcher(self, constraint: Constraint):
        """A fresh matcher at the start of the constraint's grammar; ConstraintError if it cannot start."""
        return self._started.start(constraint)

    def _compile(self, grammar_text: str) -> tuple[object, str | None, str | None]:
        """(matcher at the grammar's start, compile error, start error) under this tokenizer."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text)
        if matcher.is_error():
            return None, matcher.get_error(), None
        return matcher, None, first_token_error(matcher)

    def fill(self, matchers: list) -> torch.Tensor:
        """The allowed-token bitmask of each matcher, [len(matchers), ceil(vocab / 32)] int32 on the CPU."""
        import llguidance.torch as lltorch

        bitmask = lltorch.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        lltorch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def start_fill(self, matchers: list) -> Future:
        """fill() on the worker thread; the caller runs the forward pass meanwhile, then takes .result()."""
        return self._filler.submit(self.fill, matchers)

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """Disallow, in place, every token the bitmask forbids in the listed rows. logits: [B, vocab]."""
        import llguidance.torch as lltorch

        with torch.inference_mode():   # the logits come from the model's inference-mode forward
            index = torch.tensor(rows, device=logits.device)
            constrained = logits.index_select(0, index).float()
            lltorch.apply_token_bitmask_inplace(constrained, bitmask.to(logits.device))
            logits.index_copy_(0, index, constrained.to(logits.dtype))

    def close(self) -> None:
        self._filler.shutdown(wait=True)
        self._started.clear()

    def consume(self, matchers: list, tokens: list[int], branch_names: list[str]) -> None:
        """Advance each matcher by its sampled token, in parallel on llguidance's threads."""
        import llguidance.torch as lltorch

        accepted = lltorch.consume_token_par(self.executor, list(zip(matchers, tokens)))
        for ok, matcher, token, name in zip(accepted, matchers, tokens, branch_names):
            if not ok:
                raise ConstraintError(f"branch {name!r}: the grammar refused token {token} ({matcher.get_error()}); "
                                      f"this is a bug in the masking, please report it.")
