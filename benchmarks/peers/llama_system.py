"""llama.cpp behind systems.System's calls, through LlamaCppPeer: sequence ids of one unified KV cache. It imports
neither torch nor the engine, so that a process of its own (llama_worker.py) can run it beside nothing else."""
from __future__ import annotations

from typing import Any

from .llama_cpp_peer import LlamaCppModel, LlamaCppPeer, LlamaSetting


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

    def step(self, handles: list[Any]) -> list[int]:
        """generate hands each token back unfed (it is pending): the feed after it is the forward of the step."""
        tokens = [row[0] for row in self.peer.generate(list(handles), 1)]
        self.peer.feed([(handle, []) for handle in handles])
        return tokens

    def prune(self, handles: list[Any]) -> None:
        self.peer.prune(list(handles))

    def reset(self) -> None:
        self.peer.clear()

    def close(self) -> None:
        self.peer.close()
