"""Rank 0's handle on a tensor-parallel engine's workers: it starts them, sends them each forward's work, and ends
them.

Workers are processes of multiprocessing's spawn context (never fork: forking after CUDA started fails, and a
forked kernel would copy the notebook's whole state), running distributed/worker.py, an importable module (a
function defined in a notebook cell cannot be pickled to a spawned process). They meet rank 0 through a TCPStore
on a port the OS picks, so two engines never collide. Every wait on them checks that they are alive and has a
deadline, so a worker that never starts, fails or dies is a TensorParallelError naming it, never a hang. After such
a failure every other worker is ended and every later call raises the same error.

close() ends the workers (a close command, then terminate, then kill, each with a timeout), closes the process
groups and the store's port; a weakref.finalize does the same if the engine is dropped unclosed, or when the
interpreter (the notebook's kernel) exits.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import signal
import time
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..errors import TensorParallelError
from ..kv.layout import BatchLayout
from . import worker
from .channels import COLLECTIVE_TIMEOUT, HOST, Channels
from .spec import ModelSpec

START_TIMEOUT_S = 120.0  # a spawned worker imports torch and joins (seconds on a busy machine; minutes is a fault)
BUILD_TIMEOUT_S = 600.0  # a worker's whole-model build, counted from the end of rank 0's own (the same work)
JOIN_TIMEOUT_S = 10.0  # a worker told to close, before it is terminated, then killed
POLL_S = 0.02


def _end(processes: list[multiprocessing.Process]) -> None:
    """End the processes still running: terminate, then kill. What close() and the finalizer share."""
    processes = [process for process in processes if process.pid is not None]   # those started
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(JOIN_TIMEOUT_S)


def _exit_status(process: multiprocessing.Process) -> str:
    code = process.exitcode
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TensorGroup:
    """Ranks 1..world-1 of one engine, started on construction (rank 0 is the calling process)."""

    def __init__(self, world: int, device: torch.device, spec: ModelSpec):
        self.world, self.rank, self.device = world, 0, device
        self.broken: str | None = None  # why the workers cannot run any more, once they cannot
        # Called before the groups close (the engine's CUDA graphs, which hold the NCCL communicator).
        self.before_shutdown: list[Callable[[], None]] = []
        self._store = dist.TCPStore(HOST, 0, world, True, COLLECTIVE_TIMEOUT, wait_for_workers=False)
        self.port = self._store.port
        context = multiprocessing.get_context("spawn")
        threads = max(1, torch.get_num_threads() // world)  # the CPU's cores shared among the ranks
        self.processes = [
            context.Process(target=worker.serve, name=f"dendrite-tp-rank{rank}", daemon=True,
                            args=(rank, world, HOST, self.port, spec, str(self.rank_device(rank)), threads))
            for rank in range(1, world)]
        self._finalizer = weakref.finalize(self, _end, self.processes)
        self.channels: Channels | None = None
        try:
            for process in self.processes:
                process.start()
            self._await("joined", time.monotonic() + START_TIMEOUT_S, "start")
            self.channels = Channels(self._store, 0, world, self.rank_device(0), wait_for=self.wait_for)
        except BaseException:
            self.close()
            raise

    def rank_device(self, rank: int) -> torch.device:
        """Rank r's device: cuda:(i + r) where rank 0 runs on cuda:i; the CPU for every rank of a CPU engine."""
        if self.device.type != "cuda":
            return self.device
        return torch.device("cuda", (self.device.index or 0) + rank)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    # ---- start-up -------------------------------------------------------------------------------
    def _await(self, stage: str, deadline: float, what: str) -> list[bytes]:
        """Each worker's value under `stage/<rank>` in the store, once all have set it; TensorParallelError if one
        dies or the deadline passes first."""
        keys = [f"{stage}/{rank}" for rank in range(1, self.world)]
        while not self._store.check(keys):
            self._check_alive()
            if time.monotonic() > deadline:
                late = [key for key in keys if not self._store.check([key])]
                raise self._fail(f"worker(s) {', '.join(late)} did not {what} in time")
            time.sleep(POLL_S)
        return [self._store.get(key) for key in keys]

    def check_weights(self, checksum: list[float]) -> None:
        """Wait for every worker's whole-model checksum and compare it with rank 0's: each rank must have built the
        same weights before keeping its shard."""
        for rank, value in enumerate(self._await("checksum", time.monotonic() + BUILD_TIMEOUT_S, "build the model"),
                                     start=1):
            if pickle.loads(value) != checksum:
                raise self._fail(f"worker rank {rank} built other weights than rank 0 (their checksums differ): the "
                                 f"checkpoint changed while it loaded, or the ranks read different files")

    def setup(self, **pool: Any) -> None:
        """Have every worker build its attention backend and its KV pool shard (num_blocks, block_size, kv_dtype,
        attention, canaries), the same block ids as rank 0's, and wait until they have."""
        self.command("setup", pool)
        self._await("ready", time.monotonic() + START_TIMEOUT_S, "allocate the KV pool")

    # ---- each call ------------------------------------------------------------------------------
    def command(self, *message: Any) -> None:
        """Send one command to every worker (after checking they all live)."""
        self._check_alive()
        try:
            self.channels.send(message)
        except RuntimeError as error:
            raise self._fail(f"sending {message[0]!r} to the workers failed ({_first_line(error)})") from None

    def forward(self, layout: BatchLayout, token_ids: torch.Tensor, model: Callable[..., torch.Tensor],
                *inputs: Any) -> torch.Tensor:
        """One forward on every rank: the workers get its layout (block tables, segments, lengths) and token ids
        ([T] long), then rank 0 runs model(token_ids, *inputs), whose all-reduces meet theirs. On the CPU the ids
        travel inside the message; on CUDA they stay on the device and are broadcast over NCCL, so the host does
        not wait for the sampler."""
        on_host = token_ids.device.type == "cpu"
        self.command("forward", layout, token_ids.tolist() if on_host else None)
        with self.lockstep("a forward"):
            if not on_host:
                self.broadcast(token_ids)
            return model(token_ids, *inputs)

    @contextlib.contextmanager
    def lockstep(self, what: str) -> Iterator[None]:
        """Rank 0's side of work the workers do alongside it, collective by collective. If rank 0 fails in it, the
        workers are left waiting mid-way, and their next collective would pair with the wrong one of rank 0's: so
        they are ended, the failure propagates, and every later call raises TensorParallelError."""
        try:
            yield
        except TensorParallelError:
            raise
        except BaseException as error:
            self._fail(f"rank 0 stopped in the middle of {what} ({type(error).__name__}: {_first_line(error)}), "
                       f"leaving the workers inside it")
            raise

    def all_reduce(self, tensor: torch.Tensor, buffer: int = 0) -> None:
        """The model's hook (distributed/shard.py): sum the ranks' partial outputs in place (Channels.all_reduce)."""
        self._collective("an all-reduce", self.channels.all_reduce, tensor, buffer)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` (on its device) into the workers' tensors of its shape: a forward's token ids."""
        self._collective("a broadcast", self.channels.broadcast, tensor)

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Channels.max_over_ranks with the workers: a quantized load's scales (distributed/shard.quantize_shard)."""
        return self._collective("a maximum over the ranks", self.channels.max_over_ranks, tensor)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._collective("a gather", self.channels.gather, tensor)

    def scatter(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        self._collective("a scatter", self.channels.scatter, parts, out)

    def wait_for(self, event: torch.cuda.Event) -> None:
        """event.synchronize(), except that a worker dying, or the step not finishing within COLLECTIVE_TIMEOUT, is
        a TensorParallelError instead of a hang: the collectives inside a replayed CUDA graph have no timeout of
        their own (NCCL's watchdog follows only those launched eagerly), and would wait for a dead peer forever.
        The failure aborts the NCCL communicator, which ends the collectives the GPU is stuck in."""
        if event.query():
            return
        started = time.monotonic()
        checked = started
        while not event.query():   # a tight loop, as a synchronize spins: the host has nothing else to do
            now = time.monotonic()
            if now - checked > POLL_S:
                self._check_alive()
                checked = now
            if now - started > COLLECTIVE_TIMEOUT.total_seconds():
                raise self._fail(f"a step's collectives did not finish within "
                                 f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s (a worker hangs)")

    def graph_launched(self) -> None:
        """After rank 0 launched a CUDA graph holding the collectives (Channels.graph_launched)."""
        if self.channels is not None:
            self.channels.graph_launched()

    def _collective(self, what: str, call, *args):
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        try:
            return call(*args)
        except TensorParallelError:   # wait_for's, before an NCCL collective: it has said what failed
            raise
        except RuntimeError as error:
            raise self._fail(f"{what} with the workers failed ({_first_line(error)})") from None

    # ---- failure and the end ------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        if any(process.exitcode is not None for process in self.processes):
            raise self._fail("a worker is gone")

    def _fail(self, what: str) -> TensorParallelError:
        """The error that says what failed and how each worker ended; the workers are ended, the groups closed."""
        deadline = time.monotonic() + 1.0  # a worker that is failing has a moment to write why, and to exit
        for process in self.processes:
            if process.pid is not None:
                process.join(max(0.0, deadline - time.monotonic()))
        reports = []
        for rank, process in enumerate(self.processes, start=1):
            key = f"error/{rank}"
            reason = self._store.get(key).decode(errors="replace") if self._store.check([key]) else None
            if reason is None and process.exitcode is not None and not self._store.check([f"joined/{rank}"]):
                reason = ("it ended before joining. A spawned process imports the main module first: a script "
                          "that builds a tensor-parallel engine must do so under `if __name__ == '__main__':`")
            if process.exitcode is not None or reason is not None:
                reports.append(f"rank {rank} (pid {process.pid}) {_exit_status(process)}"
                               + (f" ({reason})" if reason else ""))
        self.broken = (f"{what}{': ' + '; '.join(reports) if reports else ''}. The engine's tensor-parallel "
                       f"workers cannot run any more; close it and load it again.")
        self._shut()
        return TensorParallelError(self.broken)

    def _shut(self) -> None:
        if self.channels is not None:   # first: releasing the graphs below may wait for a kernel stuck on a peer
            self.channels.end_waits()
        self._finalizer.detach()
        for release in self.before_shutdown:
            release()
        self.before_shutdown.clear()
        _end(self.processes)
        if self.channels is not None:
            self.channels.shutdown()

    def close(self) -> None:
        """End every worker and free the groups and the port. Safe to call twice, and after a failure."""
        if self.broken is None and self.channels is not None and all(p.is_alive() for p in self.processes):
            try:
                self.channels.send(("close",))
            except RuntimeError:   # a worker went at this very moment: ended below all the same
                pass
            for process in self.processes:
                process.join(JOIN_TIMEOUT_S)
        self.broken = self.broken or "this engine's tensor-parallel workers were closed with it."
        self._shut()
        self.channels = None
        self._store = None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
