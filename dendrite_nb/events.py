"""What the engine tells its listeners: one event per decode step and one per change of the tree.

Listeners are how the notebook layer streams text and how views update live, without the engine
knowing about either. A listener runs synchronously on the engine's thread, so it must be cheap
(coalesce and throttle on its side). It runs once what it reports is committed, so it may call the engine:
from a DecodeStep it may prune, fork, re-rank or constrain branches, which the running generate takes up
at its next step (not start another generate, nor close the engine). An exception it raises stops the call
at that point, which is a step boundary: everything the engine did before the event stays done.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True, slots=True)
class DecodeStep:
    step: int                   # 0-based index of this step within its generate call
    max_steps: int              # the steps the call takes at most: max_new_tokens x ceil(branches / max_batch)
    branches: tuple[str, ...]   # the branches decoded in this step, batch order
    tokens: tuple[int, ...]     # the token each of them appended
    finished: tuple[str, ...]   # those that stopped at this step (EOS or a stop string)
    step_s: float               # wall time of the step: sampling + forward, seconds
    # Each token's log-probability under the model, when the call keeps them (generate(..., logprobs=True)).
    logprobs: tuple[float, ...] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.branches)


@dataclass(frozen=True, slots=True)
class TreeChanged:
    reason: str                 # "new_branch", "append", "fork", "prune", "preempt", "generate", "rewind", "drop_cache"
    branches: tuple[str, ...]   # the branches the call named


Event = Union[DecodeStep, TreeChanged]
Listener = Callable[[Event], None]


class Subscription:
    """Returned by Engine.subscribe; `close()` (or leaving a `with` block) stops the delivery."""

    def __init__(self, listeners: list[Listener], listener: Listener):
        self._listeners, self.listener = listeners, listener
        listeners.append(listener)

    def close(self) -> None:
        if self.listener in self._listeners:
            self._listeners.remove(self.listener)

    def __repr__(self) -> str:
        name = getattr(self.listener, "__qualname__", None) or type(self.listener).__name__
        return f"Subscription({name}, {'delivering' if self.listener in self._listeners else 'closed'})"

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
