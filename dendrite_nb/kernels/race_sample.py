"""Temperature sampling of a batch of rows in one kernel launch: the exponential race on the device.

sampling.sample draws token argmax(p / E), E ~ Exp(1) per vocabulary entry, from each row's own generator:
on a GPU that is a division, a softmax, one noise launch per row (each row has its own generator), another
division and an argmax, about ten launches a step, which the host pays for in Python (0.24 ms a step at 5
rows on an H200 machine, docs/lab/gpu-fast-path.md). The same race in log space needs no softmax:
argmax(logits / T - log E). Here one launch does it all: each program takes BLOCK_V entries of a row, makes
its own uniforms with Philox (tl.rand) keyed by the row's (seed, offset), and writes the best of its chunk;
the last program of a row to finish (an atomic count) picks the row's winner among the chunks and resets the
count for the next call.

Each row's noise depends only on its (seed, offset), so a branch's tokens do not depend on what else is in
the batch. The caller advances each row's offset past the V numbers a draw uses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_arguments, wait_for_inputs

BLOCK_V = 4096  # vocabulary entries per program: 38 programs a row for a 152k vocabulary
INTERPRET_BLOCK_V = 16  # the CPU interpreter: small chunks, so tests cross several


@triton.jit
def _race_kernel(logits_ptr, keys_ptr, chunk_score_ptr, chunk_token_ptr, done_ptr, out_ptr, V, stride_row,
                 inv_temperature, CHUNKS, BLOCK_V: tl.constexpr, CHUNKS_POW2: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(keys_ptr + 2 * row)
    offset = tl.load(keys_ptr + 2 * row + 1)
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = v < V
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + v, mask=valid, other=float("-inf"))
    # 1 - u lies in (0, 1], so E = -log(1 - u) is finite and -log E is never NaN; a masked entry (-inf logit,
    # a constraint's refusal) stays -inf whatever its noise.
    noise = -tl.log(-tl.log(1.0 - tl.rand(seed, offset + v.to(tl.int64))))
    score = tl.where(logit == float("-inf"), float("-inf"), logit * inv_temperature + noise)
    best = tl.argmax(score, 0)
    tl.store(chunk_score_ptr + row * CHUNKS + chunk, tl.max(score, 0))
    tl.store(chunk_token_ptr + row * CHUNKS + chunk, chunk * BLOCK_V + best)
    # acq_rel: this chunk's stores are visible before the count moves; the last program sees all of them.
    if tl.atomic_add(done_ptr + row, 1) == CHUNKS - 1:
        chunks = tl.arange(0, CHUNKS_POW2)
        scores = tl.load(chunk_score_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=float("-inf"),
                         cache_modifier=".cg")
        winner = tl.argmax(scores, 0)
        token = tl.load(chunk_token_ptr + row * CHUNKS + winner, cache_modifier=".cg")
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(done_ptr + row, 0)


class RaceSampler:
    """Scratch for race_sample on one device, grown as batches grow: the per-row counts (zero between calls)
    and each chunk's best score and token; plus a pinned host twin for the rows' keys."""

    def __init__(self, device: torch.device, block_v: int | None = None):
        from . import INTERPRETED

        if device.type == "cuda" and device.index is None:  # tensors report cuda:N; compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.block_v = block_v or (INTERPRET_BLOCK_V if INTERPRETED else BLOCK_V)
        self._done = torch.zeros(0, dtype=torch.int32, device=device)
        self._chunk_score = torch.empty(0, dtype=torch.float32, device=device)
        self._chunk_token = torch.empty(0, dtype=torch.int32, device=device)
        self._keys_host = torch.empty(0, dtype=torch.int64)
        self._keys = torch.empty(0, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def __call__(self, logits: torch.Tensor, temperature: float, seeds: list[int], offsets: list[int]) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64: per row argmax(logits / temperature - log E), E ~ Exp(1)
        from Philox keyed by (seeds[row], offsets[row]); row r reads numbers offsets[r] to offsets[r] + V - 1."""
        rows, vocab = logits.shape
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.device != self.device:
            raise ValueError(f"race_sample takes float32 logits [B, V] with contiguous rows on {self.device}; got "
                             f"{logits.dtype} {tuple(logits.shape)} with strides {logits.stride()} on {logits.device}.")
        if not temperature > 0 or len(seeds) != rows or len(offsets) != rows:
            raise ValueError(f"race_sample needs a temperature > 0 and a seed and an offset per row; got "
                             f"temperature {temperature}, {len(seeds)} seeds and {len(offsets)} offsets for {rows} rows.")
        chunks = triton.cdiv(vocab, self.block_v)
        self._grow(rows, chunks)
        keys = self._upload_keys(seeds, offsets)
        tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
        _race_kernel[(rows, chunks)](logits, keys, self._chunk_score, self._chunk_token, self._done, tokens, vocab,
                                     logits.stride(0), 1.0 / temperature, chunks, BLOCK_V=self.block_v,
                                     CHUNKS_POW2=triton.next_power_of_2(chunks), num_warps=8,
                                     **pdl_arguments(logits))
        return tokens

    def _grow(self, rows: int, chunks: int) -> None:
        if len(self._done) < rows:
            self._done = torch.zeros(max(rows, 2 * len(self._done), 64), dtype=torch.int32, device=self.device)
        if len(self._chunk_score) < rows * chunks:
            size = max(rows * chunks, 2 * len(self._chunk_score))
            self._chunk_score = torch.empty(size, dtype=torch.float32, device=self.device)
            self._chunk_token = torch.empty(size, dtype=torch.int32, device=self.device)

    def _upload_keys(self, seeds: list[int], offsets: list[int]) -> torch.Tensor:
        """(seed, offset) pairs, flat [2B], on the device, through a pinned buffer rewritten only once its last
        copy ran (the pattern of ForwardGraphs._upload's staging buffer)."""
        rows = len(seeds)
        if self.device.type != "cuda":
            return torch.tensor(list(zip(seeds, offsets)), dtype=torch.int64, device=self.device)
        self._copied.synchronize()  # the last copy out of the pinned buffer has run: rewrite or replace it
        if len(self._keys_host) < 2 * rows:
            self._keys_host = torch.empty(max(2 * rows, 128), dtype=torch.int64).pin_memory()
            self._keys = torch.empty(len(self._keys_host), dtype=torch.int64, device=self.device)
        host = self._keys_host.numpy()
        host[0: 2 * rows: 2] = seeds
        host[1: 2 * rows: 2] = offsets
        self._keys[: 2 * rows].copy_(self._keys_host[: 2 * rows], non_blocking=True)
        self._copied.record()
        return self._keys
