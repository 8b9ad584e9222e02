"""A tensor-parallel worker: rank r (1..N-1) of an engine, a process spawned by distributed/group.py.

It builds its shard of the model rank 0 splits (from the ModelSpec), reports the whole model's checksum, and then
does what rank 0 tells it, one command at a time, until told to close:

    setup    build the attention backend and this rank's KV pool (its KV heads, rank 0's block ids), and on CUDA
             the fused kernels and CUDA graphs where rank 0 runs them
    forward  plan the attention from rank 0's layout and run the shard's forward (its all-reduces meet rank 0's)
    graph    capture or replay the CUDA graph rank 0 names, with rank 0's packed plan (cuda_graphs.py)
    copy     copy KV blocks (copy-on-write), as rank 0 did in its own pool
    export   send the given blocks' KV to rank 0 (preemption to host memory)
    import   take this rank's heads of the given blocks' KV from rank 0 (resuming a preempted branch)
    close    exit

It holds no tree, allocator or sampler: rank 0 owns those, and only rank 0 decides. Whatever fails here is written
to the store under error/<rank> before the process exits, so rank 0's error says why.
"""
from __future__ import annotations

import multiprocessing.util
import os
import pickle
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from ..attention import make_backend
from ..cuda_graphs import ForwardGraphs
from ..kv import KVPool
from .channels import COLLECTIVE_TIMEOUT, Channels
from .shard import connect, local_heads, quantize_shard
from .spec import ModelSpec


class Worker:
    def __init__(self, channels: Channels, model: torch.nn.Module, device: torch.device):
        self.channels, self.model, self.device = channels, model, device
        self.backend = self.pool = self.kv_layers = self.graphs = None

    def setup(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, attention: str, canaries: bool,
              fused_kernels: bool = False, cuda_graphs: bool = False) -> None:
        config = self.model.config
        heads, kv_heads = local_heads(config, self.model.tensor_parallel[1])
        dtype = next(self.model.parameters()).dtype
        self.backend = make_backend(attention, self.device, dtype, config.head_dim, kv_dtype)
        if self.backend.capabilities.needs_head_layout:
            self.backend.configure(heads, kv_heads, kv_dtype)
        self.pool = KVPool(num_layers=config.num_layers, num_kv_heads=kv_heads, head_dim=config.head_dim,
                           num_blocks=num_blocks, block_size=block_size, dtype=kv_dtype, device=self.device,
                           canaries=canaries)
        self.kv_layers = self.pool.layers()
        if fused_kernels:   # as rank 0's model: the same kernels, and graphs capture the same collectives
            self.model.use_fused_kernels(True)
        if cuda_graphs:
            self.graphs = ForwardGraphs(self.model, self.backend, self.kv_layers, self.device, block_size,
                                        self.pool.sink_slot, broadcast=self.channels.broadcast,
                                        launched=self.channels.graph_launched)

    def forward(self, layout, token_ids: list[int] | None) -> None:
        if token_ids is None:   # on CUDA the ids come over the device group, from rank 0's sampler
            ids = torch.empty(sum(layout.q_lens), dtype=torch.long, device=self.device)
            self.channels.broadcast(ids)
        else:
            ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        plan = self.backend.plan(layout, self.pool.block_size, self.device)
        positions = torch.tensor(layout.positions, dtype=torch.long, device=self.device)
        self.model(ids, positions, self.kv_layers, self.backend, plan)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        pairs_t = torch.tensor(pairs, dtype=torch.long, device=self.device)  # [copies, 2]
        self.pool.copy_blocks(pairs_t[:, 0], pairs_t[:, 1])

    def export(self, block_ids: list[int]) -> None:
        kv, scales = self.pool.export_blocks(block_ids)
        self.channels.gather(kv)
        if scales is not None:
            self.channels.gather(scales)

    def import_(self, block_ids: list[int], kv_shape: tuple[int, ...], scales_shape: tuple[int, ...] | None) -> None:
        kv = torch.empty(kv_shape, dtype=torch.uint8)
        self.channels.scatter(None, kv)
        scales = None
        if scales_shape is not None:
            scales = torch.empty(scales_shape, dtype=torch.float32)
            self.channels.scatter(None, scales)
        self.pool.import_blocks(block_ids, (kv, scales))

    def run(self, store: dist.Store, rank: int) -> None:
        """Do rank 0's commands until it says close."""
        while True:
            kind, *args = self.channels.receive()
            if kind == "close":
                return
            if kind == "setup":
                self.setup(**args[0])
                store.set(f"ready/{rank}", b"1")
            elif kind == "forward":
                self.forward(*args)
            elif kind == "graph":
                self.graphs.follow(*args)
            elif kind == "copy":
                self.copy(*args)
            elif kind == "export":
                self.export(*args)
            elif kind == "import":
                self.import_(*args)
            else:
                raise ValueError(f"unknown command {kind!r} from rank 0")


def serve(rank: int, world: int, host: str, port: int, spec: ModelSpec, device_name: str, threads: int) -> None:
    """The worker process's entry point (multiprocessing's target): join rank 0, build, serve, exit."""
    # A terminal's Ctrl-C reaches the whole process group; rank 0 alone decides where a call stops (at a step's
    # end, engine_calls.py), and the workers follow its commands.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore(host, port, world, False, COLLECTIVE_TIMEOUT)
    try:
        torch.set_num_threads(threads)
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(f"joined/{rank}", b"1")
        channels = Channels(store, rank, world, device)
        model, _, _, checksum, _ = spec.build_shard(rank, world, device, tokenizer=False)
        store.set(f"checksum/{rank}", pickle.dumps(checksum))
        if spec.weights is not None:   # with rank 0 and the other workers, product by product
            quantize_shard(model, spec.weights, channels.max_over_ranks)
        connect(model, rank, world, channels.all_reduce)
        with torch.inference_mode():
            Worker(channels, model, device).run(store, rank)
    except BaseException as error:
        try:
            store.set(f"error/{rank}", _describe(error).encode())
        except RuntimeError:   # rank 0, which holds the store, is gone: nobody is left to tell
            pass
        raise SystemExit(1) from None
    # Told to close: nothing is left to save. The exit closes the groups' connections; shutting NCCL's down here
    # would wait on rank 0's (which is waiting for this process to end), and the interpreter's own teardown
    # (torch's) would keep rank 0's close() waiting for a second or more. Multiprocessing's exit handlers still
    # run, as for any process it started: they unlink the named semaphores made here (tqdm's lock, while loading),
    # which would otherwise stay in /dev/shm until the kernel exits.
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _describe(error: BaseException) -> str:
    """The error and the line of this package that raised it (the whole traceback would not fit a message)."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "dendrite_nb" in frame.filename]
    where = f" (at {frames[-1].filename.rsplit('dendrite_nb', 1)[-1].lstrip('/')}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}{where}"
