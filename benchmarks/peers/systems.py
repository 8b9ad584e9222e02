"""The five calls every benchmarked system offers, so that each workload (workloads.py) is written once and run
unchanged on this engine and on llama.cpp: root (prefill a prompt from empty), fork, extend (prefill several
branches' tokens in shared forwards), generate (greedy, all given branches in one batch per step) and prune.

  EngineSystem   dendrite_nb's Engine through its public API only: new_branch, fork, append_many, generate, prune.
  LlamaSystem    llama.cpp through LlamaCppPeer (llama_cpp_peer.py): sequence ids of one unified KV cache.

Both take and return token ids: the prompts are tokenized once, by the engine's tokenizer, and the same ids go to
both (the script checks that llama.cpp's tokenizer agrees). Handles are whatever the system's own are (an engine
Branch, a LlamaSequence); a workload only passes them back.
"""
from __future__ import annotations

import itertools
from typing import Any, Protocol

from dendrite_nb import Engine, SamplingParams

from .llama_cpp_peer import LlamaCppModel, LlamaCppPeer, LlamaSetting

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)  # every run decodes exactly the asked number of tokens


class System(Protocol):
    label: str  # "engine float32", "llama.cpp q4_1, 2 threads, FA off, KV f16"

    def root(self, tokens: list[int]) -> Any: ...
    def fork(self, handle: Any, n: int) -> list[Any]: ...
    def extend(self, items: list[tuple[Any, list[int]]]) -> None: ...
    def generate(self, handles: list[Any], max_new_tokens: int) -> list[list[int]]: ...
    def prune(self, handles: list[Any]) -> None: ...
    def reset(self) -> None: ...   # everything pruned; not timed
    def close(self) -> None: ...


class EngineSystem:
    """This engine, public API only. Branch names are numbered; reset prunes every branch."""

    def __init__(self, engine: Engine, label: str):
        self.engine, self.label = engine, label
        self._names = itertools.count()

    def root(self, tokens: list[int]) -> Any:
        return self.engine.new_branch(f"r{next(self._names)}", tokens)

    def fork(self, handle: Any, n: int) -> list[Any]:
        return self.engine.fork(handle, n)

    def extend(self, items: list[tuple[Any, list[int]]]) -> None:
        self.engine.append_many(items)

    def generate(self, handles: list[Any], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(handles, max_new_tokens, GREEDY)

    def prune(self, handles: list[Any]) -> None:
        self.engine.prune(list(handles))

    def reset(self) -> None:
        if self.engine.branches:
            self.engine.prune(list(self.engine.branches))

    def close(self) -> None:
        self.reset()


class LlamaSystem:
    """llama.cpp at one setting, one context sized for one workload (n_ctx cells, n_seq_max sequence ids)."""

    def __init__(self, model: LlamaCppModel, weights: str, setting: LlamaSetting, n_ctx: int, n_seq_max: int):
        self.peer = LlamaCppPeer(model, setting, n_ctx, n_seq_max)
        self.weights, self.setting = weights, setting
        self.label = f"llama.cpp {weights}, {setting.describe()}"

    def root(self, tokens: list[int]) -> Any:
        sequence = self.peer.new_sequence()
        self.peer.feed([(sequence, tokens)])
        return sequence

    def fork(self, handle: Any, n: int) -> list[Any]:
        return self.peer.fork(handle, n)

    def extend(self, items: list[tuple[Any, list[int]]]) -> None:
        self.peer.feed(list(items))

    def generate(self, handles: list[Any], max_new_tokens: int) -> list[list[int]]:
        return self.peer.generate(list(handles), max_new_tokens)

    def prune(self, handles: list[Any]) -> None:
        self.peer.prune(list(handles))

    def reset(self) -> None:
        self.peer.clear()

    def close(self) -> None:
        self.peer.close()
