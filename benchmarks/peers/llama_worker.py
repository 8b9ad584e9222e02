"""llama.cpp in a worker process of its own, so that it never shares a process with torch on a GPU.

On an H200, a benchmark process that ran the engine (torch, CUDA) ended without a word, no traceback, once it had
loaded a CUDA build of llama.cpp and gone on to put the weights on the GPU and build the engine; a process without
torch ran the same build, file and calls (the cause was not found: llama.cpp's log was muted). So the process that
runs the engine never loads llama.cpp: it asks this worker, one request at a time, over pickles on the worker's
stdin and stdout.

  LlamaWorker(gguf, n_gpu_layers, split)  the parent's end; starts `python -m peers.llama_worker` (from
                                    benchmarks/) on its first request and again after the worker has died; split:
                                    how the model spreads over the GPUs (llama_types.SPLIT_MODES)
    .info()                         llama.cpp's sequence-id limit and version
    .sanity(setting, prompt, n)     the logits after `prompt` (None with backend sampling) and n greedy tokens
  RemoteSession(worker, ...)        sweep.Session's counterpart (open, run, close) for a llama.cpp variant: the
                                    workload objects travel to the worker, which opens a LlamaSystem, runs the whole
                                    workload once untimed, warms up, prepares, and times each run itself, as a
                                    Session does, so no pipe is inside a timed region.

A failure in the worker comes back as a LlamaCppError (llama.cpp's own refusals keep their message); a worker that
dies is reported so, and the next request starts a new one.
"""
from __future__ import annotations

import faulthandler
import itertools
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from .llama_types import LlamaCppError, LlamaSetting

BENCHMARKS = Path(__file__).resolve().parents[1]


class LlamaWorker:
    def __init__(self, gguf: str | Path, n_gpu_layers: int, split: str = "none"):
        self.gguf, self.n_gpu_layers, self.split = Path(gguf), n_gpu_layers, split
        self.generation = 0  # workers started so far: a session belongs to the one that opened it
        self._process: subprocess.Popen | None = None
        self._keys = itertools.count()

    def call(self, kind: str, *args: Any) -> Any:
        if self._process is None or self._process.poll() is not None:
            self._start()
        process = self._process
        try:
            pickle.dump((kind, *args), process.stdin)
            process.stdin.flush()
            status, value = pickle.load(process.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            code = process.wait()
            self._process = None
            raise LlamaCppError(f"the llama.cpp worker process ended (exit code {code}) during {kind!r}; its "
                                f"stderr above says why (LLAMA_CPP_VERBOSE=1 shows llama.cpp's log).") from None
        if status == "error":
            error_type, message = value
            raise LlamaCppError(message if error_type == "LlamaCppError" else f"{error_type} in the llama.cpp "
                                                                               f"worker: {message}")
        return value

    def _start(self) -> None:
        self.generation += 1
        self._process = subprocess.Popen([sys.executable, "-m", "peers.llama_worker", str(self.gguf),
                                          str(self.n_gpu_layers), self.split], cwd=BENCHMARKS,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def alive(self, generation: int) -> bool:
        return self.generation == generation and self._process is not None and self._process.poll() is None

    def info(self) -> dict[str, Any]:
        return self.call("info")

    def sanity(self, setting: LlamaSetting, prompt: list[int], tokens: int):
        return self.call("sanity", setting, prompt, tokens)

    def session_key(self) -> int:
        return next(self._keys)

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()   # the worker ends at the end of its input
            self._process.wait(timeout=60)
        self._process = None


class RemoteSession:
    """One llama.cpp variant's session for one workload, in the worker (see the module docstring)."""

    def __init__(self, worker: LlamaWorker, weights: str, setting: LlamaSetting, workload: Any, texts: Any):
        self.worker, self.key = worker, worker.session_key()
        worker.call("open", self.key, weights, setting, workload, texts)
        self.generation = worker.generation

    def run(self, guard: Any, log: Callable[[str], None]) -> tuple[dict[str, float], list[int]]:
        (figures, tokens), others = guard.run(lambda: self.worker.call("run", self.key), log)
        return {**figures, "others_cores": others}, tokens

    def close(self) -> None:
        if self.worker.alive(self.generation):   # a dead worker took its sessions with it
            self.worker.call("close", self.key)


# ---- the worker's side ------------------------------------------------------------------------------
class _Worker:
    def __init__(self, gguf: Path, n_gpu_layers: int, split: str):
        from .llama_cpp_peer import LlamaCppModel

        self.model = LlamaCppModel(gguf, n_gpu_layers, split)
        self.sessions: dict[int, tuple[Any, Any, Any]] = {}

    def info(self) -> dict[str, Any]:
        import llama_cpp
        from llama_cpp import llama_cpp as lib

        return {"max_sequences": lib.llama_max_parallel_sequences(), "version": llama_cpp.__version__}

    def sanity(self, setting: LlamaSetting, prompt: list[int], tokens: int):
        from .llama_cpp_peer import LlamaCppPeer

        peer = LlamaCppPeer(self.model, setting, n_ctx=len(prompt) + tokens + 256, n_seq_max=1)
        try:
            sequence = peer.new_sequence()
            peer.feed([(sequence, prompt)])
            logits = None if setting.backend_sampling else peer.logits(len(prompt) - 1).copy()
            (generated,) = peer.generate([sequence], tokens)
        finally:
            peer.close()
        return logits, generated

    def open(self, key: int, weights: str, setting: LlamaSetting, workload: Any, texts: Any) -> None:
        from .llama_system import LlamaSystem
        from .sweep import WARM_UP_CELLS, WARM_UP_SEQUENCES, warm_run, warm_up

        system = LlamaSystem(self.model, weights, setting, max(workload.cells(), WARM_UP_CELLS),
                             max(workload.sequences(), WARM_UP_SEQUENCES))
        try:
            warm_run(system, workload)
            warm_up(system, texts)
            self.sessions[key] = (system, workload, workload.prepare(system))
        except BaseException:
            system.close()
            raise

    def run(self, key: int):
        system, workload, state = self.sessions[key]
        return workload.run(system, state)

    def close(self, key: int) -> None:
        system, _, _ = self.sessions.pop(key)
        system.reset()
        system.close()


def serve(gguf: Path, n_gpu_layers: int, split: str = "none") -> None:
    faulthandler.enable()   # a crash inside llama.cpp still says which request it was (on stderr)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)   # whatever else prints (Python or llama.cpp's C code) goes to stderr: stdout carries replies only
    requests = sys.stdin.buffer
    worker = _Worker(gguf, n_gpu_layers, split)
    while True:
        try:
            kind, *args = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", getattr(worker, kind)(*args))
        except Exception as error:   # sent back: the parent decides what a failure means
            reply = ("error", (type(error).__name__, str(error)))
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])
