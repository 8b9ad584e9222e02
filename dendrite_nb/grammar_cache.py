"""Compile each llguidance grammar once: the compiles that check a constraint and start its matcher, cached.

A grammar compiles in two places. parse_constraint checks a spec without a model (no tokenizer), and an engine
starts a matcher under its tokenizer when a generation begins. Both are cached by the grammar's text
(Constraint.grammar_text), the least recently used dropped first, so a schema that comes back (a re-run cell,
the next request of a server, a restore) compiles no more; and a grammar an engine has started counts as
checked. An engine that parses through its own start (Grammars.parse) so compiles a new spec once in all.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

from .constraints import Constraint
from .errors import ConstraintError

# Distinct grammars kept, per cache. A started matcher of a large schema holds its compiled grammar and lexer
# (up to a few MB); a session or a server uses a handful of schemas at a time.
GRAMMARS_KEPT = 32


class Recent:
    """A mapping that keeps its `size` most recently used keys. Thread-safe: a server's request handlers may
    check specs while its engine thread starts them."""

    def __init__(self, size: int):
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._size, self._lock = size, threading.Lock()

    def get(self, key: str, make: Callable[[str], Any]) -> Any:
        """The value kept for `key`, or make(key), kept. make runs outside the lock: two threads may both make
        a value that neither had, and the later one is kept."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make(key)
        self.put(key, value)
        return value

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            if len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


# grammar text -> llguidance's compile error, or None: the checks of every spec parsed in this process
_checked = Recent(GRAMMARS_KEPT)


def _compile_error(grammar_text: str) -> str | None:
    """llguidance's error for a grammar compiled without a tokenizer, or None (its warnings are not errors)."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text)
    return "; ".join(messages).strip() if is_error else None


def check(constraint: Constraint) -> None:
    """Raise ConstraintError unless llguidance compiles the constraint's grammar."""
    error = _checked.get(constraint.grammar_text(), _compile_error)
    if error:
        raise ConstraintError(f"llguidance cannot compile this {constraint.kind}: {error}")


class StartedGrammars:
    """Matchers at the start of their grammar under one tokenizer, untouched, by grammar text: each grammar
    compiles (and is probed) once, and each start after the first is a deep copy (about 2 us)."""

    def __init__(self, compile_matcher: Callable[[str], tuple[Any, str | None, str | None]]):
        # compile_matcher(grammar_text) -> (matcher, compile error, start error); a failure is kept too, so a
        # grammar that fails is not compiled again to fail the same way
        self._compile, self._started = compile_matcher, Recent(GRAMMARS_KEPT)

    def start(self, constraint: Constraint):
        """A fresh matcher at the start of the constraint's grammar; ConstraintError if it cannot compile or
        start (some grammars compile and fail only when their lexer first runs)."""
        matcher, compile_error, start_error = self._started.get(constraint.grammar_text(), self._compiled)
        if compile_error:
            raise ConstraintError(f"llguidance cannot compile this {constraint.kind}: {compile_error}")
        if start_error:
            raise ConstraintError(_start_failure(constraint.kind, start_error))
        return matcher.deep_copy()

    def _compiled(self, grammar_text: str) -> tuple[Any, str | None, str | None]:
        outcome = self._compile(grammar_text)
        if outcome[1] is None:   # compiled under a tokenizer: a check without one needs no compile of its own
            _checked.put(grammar_text, None)
        return outcome

    def clear(self) -> None:
        self._started.clear()


def _start_failure(kind: str, start_error: str) -> str:
    """What a user reads when a grammar compiles but cannot start. llguidance's error is one line of cause, then its
    parser's state and the grammar (hundreds of characters a user cannot act on): the first line is kept."""
    cause = start_error.strip().splitlines()[0] if start_error.strip() else "no reason given"
    if cause == "NoExtensionBias":   # no token can begin any text the grammar accepts
        return (f"this {kind} matches no text this model's tokens can write (llguidance: {cause}); check that it "
                f"accepts at least one string.")
    return f"llguidance cannot start this {kind}: {cause}"
