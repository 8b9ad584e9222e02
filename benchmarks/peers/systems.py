"""The calls every benchmarked system offers, so that each workload (workloads.py) is written once and run
unchanged on this engine and on llama.cpp: root (prefill a prompt from empty), fork, extend (prefill several
branches' tokens in shared forwards), generate (greedy, all given branches in one batch per step), step (each
branch's next token chosen and fed: one forward of all of them) and prune.

  EngineSystem   dendrite_nb's Engine through its public API only: new_branch, fork, append_many, generate, prune.
  LlamaSystem    llama.cpp through LlamaCppPeer (llama_cpp_peer.py): sequence ids of one unified KV cache; in
                 llama_system.py, which imports neither torch nor the engine (a worker process runs it alone).

Both take and return token ids: the prompts are tokenized once, by the engine's tokenizer, and the same ids go to
both (the script checks that llama.cpp's tokenizer agrees). Handles are whatever the system's own are (an engine
Branch, a LlamaSequence); a workload only passes them back. Every call returns once its work is done, so that a
timed region ends with it: llama.cpp's decodes read their results back, and on a GPU the engine's calls wait for
the device (a prefill, a fork's copy-on-write, an append would otherwise still run on it).
"""
from __future__ import annotations

import itertools
from typing import Any, Protocol

from bench_common import sync
from dendrite_nb import Engine, SamplingParams


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)  # every run decodes exactly the asked number of tokens


class System(Protocol):
    label: str  # "engine float32", "llama.cpp q4_1, 2 threads, FA off, KV f16"

    def root(self, tokens: list[int]) -> Any: ...
    def fork(self, handle: Any, n: int) -> list[Any]: ...
    def extend(self, items: list[tuple[Any, list[int]]]) -> None: ...
    def generate(self, handles: list[Any], max_new_tokens: int) -> list[list[int]]: ...
    def step(self, handles: list[Any]) -> list[int]: ...
    def prune(self, handles: list[Any]) -> None: ...
    def reset(self) -> None: ...   # everything pruned; not timed
    def close(self) -> None: ...


class EngineSystem:
    """This engine, public API only. Branch names are numbered; reset prunes every branch."""

    def __init__(self, engine: Engine, label: str):
        self.engine, self.label = engine, label
        self._names = itertools.count()

    def root(self, tokens: list[int]) -> Any:
        branch = self.engine.new_branch(f"r{next(self._names)}", tokens)
        sync(self.engine.device)
        return branch

    def fork(self, handle: Any, n: int) -> list[Any]:
        kids = self.engine.fork(handle, n)
        sync(self.engine.device)
        return kids

    def extend(self, items: list[tuple[Any, list[int]]]) -> None:
        self.engine.append_many(items)
        sync(self.engine.device)

    def generate(self, handles: list[Any], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(handles, max_new_tokens, GREEDY)

    def step(self, handles: list[Any]) -> list[int]:
        """generate(handles, 1): each token is sampled from the logits after the branch's end, then fed."""
        return [row[0] for row in self.engine.generate(handles, 1, GREEDY)]

    def prune(self, handles: list[Any]) -> None:
        self.engine.prune(list(handles))
        sync(self.engine.device)

    def reset(self) -> None:
        if self.engine.branches:
            self.engine.prune(list(self.engine.branches))

    def close(self) -> None:
        self.reset()
