"""Sampling under temperature, top-k, top-p and min-p in one kernel launch, without sorting the vocabulary.

sampling.sample's torch path sorts each [vocab] row, takes a cumulative sum, scatters the cut back and draws the
noise one launch per row (each row has its own generator): at a 151,936-token vocabulary that made a 20-row decode
step 2.92 ms against 1.83 ms greedy on an H100. Here each row's filtered set F is found without sorting the row,
and the token is a race, argmax over F of (logit / T + Gumbel noise), the noise from Philox keyed by the row's
(seed, offset) at offset + token id, as kernels/race_sample.py draws it. Each row has its own settings, so rows of
a mixed batch take one launch, and its token depends only on its own logits, settings and key, never on the batch.

Semantics, as sampling.filter_probs computes them in torch (the CPU path and the tests' reference): over
x = logits / T, top-k keeps every token whose logit is at least the k-th largest (ties at the k-th all kept);
top-p then keeps, in the order (x descending, token id ascending), each token whose mass before it, over the
top-k set renormalised, is under top_p; min-p last keeps tokens whose probability is at least min_p times the
best's (a ratio, so the same before or after renormalising). Every rule keeps a prefix of that order, so F is one
too. The distribution differs from the torch path's only by float32 rounding at a boundary (a mass summed in
another order).

One launch of (rows, chunks) programs:
1. Each program takes a chunk of the row: every CHUNKS-th run of SEGMENT consecutive ids (a tokenizer gives its
   common tokens the low ids; this spreads them over the chunks). It writes its best x, its sum of exp(x - best),
   and the ids of its most likely tokens: all those above a cut, found from a histogram of (best - x) in steps of
   2^(1/3) so that at most CANDIDATES are kept; the chunk's cut is the largest x it did not keep. A row with no
   filter races over its chunk instead (race_sample's work, the same draw), and a greedy row (inverse temperature
   0) takes its chunk's argmax.
2. The last program of a row to finish (an atomic count) gathers the kept ids. Every token above the largest cut
   of all chunks was kept, so those tokens, sorted (CHUNKS x CANDIDATES at most, in registers), are a prefix of the
   row's order, with exact counts and masses before each token. When F ends inside that prefix (top-k up to a
   few hundred, a nucleus or min-p set of up to several hundred tokens) the race runs over it: done.
3. Otherwise that program goes on alone with passes over the row (kernels/filtered_passes.py): top-p by rejection,
   about two passes, top-k by radix select when k is past the prefix, eight more.

A filtered draw reads NOISE_ROUNDS strides (V rounded up to 4) of its row's Philox numbers, whichever step ended
it (filtered_passes says why), and an unfiltered one one stride, as race_sample's; a greedy one none. The caller
advances each row's offset by that much.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .filtered_passes import NO_BOUND, NOISE_ROUNDS, UNKNOWN_KEY, gumbel, key_value, order_key, winner_by_passes
from .pdl import pdl_arguments, wait_for_inputs

BLOCK_V = 4096  # vocabulary entries per program of step 1: 38 programs a row at a 151,936-token vocabulary
SEGMENT = 32  # consecutive ids a program takes together: one 128-byte line of float32 logits
CANDIDATES = 32  # a chunk keeps at most this many of its most likely tokens (38 chunks: 1,216, sorted in step 2)
LADDER = 32  # histogram steps of 2^(1/3) below a chunk's best x, from 1/16 to 64 (the last catches the rest)
FALLBACK_BLOCK = 4096  # entries per iteration of step 3's passes over a row (one program, NUM_WARPS warps)
# 16 warps: 90 registers a thread for sm_90 (ptxas), so a block a multiprocessor. 8 warps took 174 (one 8-warp
# block a multiprocessor, too few loads in flight for step 1 at 256 rows), 104 with FALLBACK_BLOCK 1024.
NUM_WARPS = 16
# The CPU interpreter: tiny chunks, so that tests on vocabularies of tens of tokens cross several chunks, fill the
# candidate lists and reach step 3, whose passes then take a test's row in one block (tests cross blocks on purpose).
INTERPRET_BLOCK_V, INTERPRET_SEGMENT, INTERPRET_CANDIDATES, INTERPRET_FALLBACK_BLOCK = 16, 4, 4, 64

INT32_MAX, INT64_MAX = tl.constexpr(2**31 - 1), tl.constexpr(2**63 - 1)  # tl.constexpr: kernels read them
KEY_SHIFT = tl.constexpr(2**32)  # a sort key is (descending order key) * 2^32 + token id


@triton.jit
def _filtered_kernel(logits_ptr, keys_ptr, knobs_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_cut_ptr, chunk_count_ptr,
                     chunk_score_ptr, chunk_token_ptr, candidates_ptr, done_ptr, out_ptr, V, stride_row, CHUNKS,
                     BLOCK_V: tl.constexpr, SEGMENT: tl.constexpr, CANDIDATES: tl.constexpr,
                     CANDIDATES_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr, LADDER: tl.constexpr,
                     FALLBACK_BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(keys_ptr + 3 * row)
    offset = tl.load(keys_ptr + 3 * row + 1)
    top_k = tl.load(keys_ptr + 3 * row + 2)  # 0: off (the caller turns k >= V into 0)
    inv_temperature = tl.load(knobs_ptr + 4 * row)  # 0: greedy
    top_p = tl.load(knobs_ptr + 4 * row + 1)
    min_p = tl.load(knobs_ptr + 4 * row + 2)
    greedy = inv_temperature == 0.0
    unfiltered = (top_k == 0) & (top_p >= 1.0) & (min_p <= 0.0)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    slot = row * CHUNKS + chunk
    j = tl.arange(0, BLOCK_V)
    token = ((j // SEGMENT) * CHUNKS + chunk) * SEGMENT + j % SEGMENT  # ascending along j
    logit = tl.load(row_logits + token, mask=token < V, other=float("-inf"))
    if greedy | unfiltered:
        if greedy:
            score = logit
        else:  # a masked entry (-inf logit, a constraint's refusal) stays -inf whatever its noise
            noise = gumbel(seed, offset + token.to(tl.int64))
            score = tl.where(logit == float("-inf"), float("-inf"), logit * inv_temperature + noise)
        index = tl.argmax(score, 0)
        tl.store(chunk_score_ptr + slot, tl.max(score, 0))
        tl.store(chunk_token_ptr + slot, ((index // SEGMENT) * CHUNKS + chunk) * SEGMENT + index % SEGMENT)
    else:
        x = logit * inv_temperature
        finite = x > float("-inf")
        best = tl.max(x, 0)
        tl.store(chunk_max_ptr + slot, best)
        best = tl.where(best > float("-inf"), best, 0.0)  # a chunk of refused tokens: no -inf - -inf (NaN)
        tl.store(chunk_sum_ptr + slot, tl.sum(tl.where(finite, tl.exp(x - best), 0.0), 0))
        depth = tl.where(finite, best - x, 0.0)  # log-probability under the chunk's best token
        step = tl.floor(3.0 * tl.log2(tl.maximum(depth, 1e-30) * 16.0)) + 1.0
        step = tl.minimum(tl.maximum(step, 0.0), LADDER - 1.0).to(tl.int32)
        # Keep the deepest steps whose tokens fit: the cut is never inside a step, so no tie is split.
        cut = tl.sum((tl.cumsum(tl.histogram(step, LADDER, mask=finite), 0) <= CANDIDATES).to(tl.int32), 0) - 1
        kept = finite & (step <= cut)
        position = tl.cumsum(kept.to(tl.int32), 0) - 1
        tl.store(candidates_ptr + slot * CANDIDATES + position, token, mask=kept)
        tl.store(chunk_count_ptr + slot, tl.sum(kept.to(tl.int32), 0))
        tl.store(chunk_cut_ptr + slot, tl.max(tl.where(kept, float("-inf"), x), 0))
    # acq_rel: this chunk's stores are visible before the count moves; the last program sees all of them.
    if tl.atomic_add(done_ptr + row, 1) == CHUNKS - 1:
        if greedy | unfiltered:
            winner = _best_of_chunks(chunk_score_ptr, chunk_token_ptr, row * CHUNKS, CHUNKS, CHUNKS_POW2)
        else:
            winner = _filtered_winner(row_logits, chunk_max_ptr, chunk_sum_ptr, chunk_cut_ptr, chunk_count_ptr,
                                      candidates_ptr, row * CHUNKS, V, CHUNKS, inv_temperature, top_k, top_p, min_p,
                                      seed, offset, CANDIDATES, CANDIDATES_POW2, CHUNKS_POW2, FALLBACK_BLOCK)
        tl.store(out_ptr + row, winner.to(tl.int64))
        tl.store(done_ptr + row, 0)


@triton.jit
def _best_of_chunks(chunk_score_ptr, chunk_token_ptr, base, CHUNKS, CHUNKS_POW2: tl.constexpr):
    """The best chunk winner; equal scores go to the lowest id (a greedy row's argmax, as torch's)."""
    chunks = tl.arange(0, CHUNKS_POW2)
    inside = chunks < CHUNKS
    scores = tl.load(chunk_score_ptr + base + chunks, mask=inside, other=float("-inf"), cache_modifier=".cg")
    tokens = tl.load(chunk_token_ptr + base + chunks, mask=inside, other=INT32_MAX, cache_modifier=".cg")
    winner = tl.min(tl.where(inside & (scores == tl.max(scores, 0)), tokens, INT32_MAX), 0)
    return tl.where(winner == INT32_MAX, 0, winner)  # NaN logits match no score: token 0, as a NaN argmax gives


@triton.jit
def _filtered_winner(row_logits, chunk_max_ptr, chunk_sum_ptr, chunk_cut_ptr, chunk_count_ptr, candidates_ptr, base,
                     V, CHUNKS, inv_temperature, top_k, top_p, min_p, seed, offset, CANDIDATES: tl.constexpr,
                     CANDIDATES_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr, FALLBACK_BLOCK: tl.constexpr):
    """Step 2: the row's winner from its chunks' candidates, or from step 3 when F reaches past them."""
    chunks = tl.arange(0, CHUNKS_POW2)
    inside = chunks < CHUNKS
    chunk_best = tl.load(chunk_max_ptr + base + chunks, mask=inside, other=float("-inf"), cache_modifier=".cg")
    chunk_sum = tl.load(chunk_sum_ptr + base + chunks, mask=inside, other=0.0, cache_modifier=".cg")
    cut = tl.max(tl.load(chunk_cut_ptr + base + chunks, mask=inside, other=float("-inf"), cache_modifier=".cg"), 0)
    best = tl.max(chunk_best, 0)
    best = tl.where(best > float("-inf"), best, 0.0)  # a row of refused tokens: no -inf - -inf (NaN)
    total = tl.sum(tl.where(chunk_best > float("-inf"), chunk_sum * tl.exp(chunk_best - best), 0.0), 0)

    i = tl.arange(0, CANDIDATES_POW2)
    owner = i // CANDIDATES
    count = tl.load(chunk_count_ptr + base + owner, mask=owner < CHUNKS, other=0, cache_modifier=".cg")
    stored = (owner < CHUNKS) & (i % CANDIDATES < count)
    ids = tl.load(candidates_ptr + (base + owner) * CANDIDATES + i % CANDIDATES, mask=stored, other=0,
                  cache_modifier=".cg")
    x = tl.load(row_logits + ids, mask=stored, other=float("-inf")) * inv_temperature
    known = stored & (x > cut)  # every token of the row above the cut was kept by its chunk
    key = tl.sort(tl.where(known, (-order_key(x) - 1) * KEY_SHIFT + ids.to(tl.int64), INT64_MAX))
    known = key != INT64_MAX  # the row's order: x descending, then id ascending
    ids = (key & 0xFFFFFFFF).to(tl.int32)
    x = key_value(-(key >> 32) - 1)
    prob = tl.where(known, tl.exp(x - best), 0.0)  # relative to the best token's
    n_known = tl.sum(known.to(tl.int32), 0)
    position = tl.arange(0, CANDIDATES_POW2)

    # top-k: the k-th largest and all its ties. Known when k is within the prefix (or the prefix is the whole row).
    kth = tl.max(tl.where(known & (position == top_k - 1), x, float("-inf")), 0)  # -inf when top_k is 0
    in_top_k = known & (x >= kth)
    top_k_known = (top_k == 0) | (top_k <= n_known) | (cut == float("-inf"))
    mass_k = tl.where(top_k > 0, tl.sum(tl.where(in_top_k, prob, 0.0), 0), total)
    before = tl.cumsum(prob, 0) - prob
    keep = in_top_k & (before < tl.where(top_p >= 1.0, float("inf"), top_p * mass_k)) & (prob >= min_p)
    n_keep = tl.sum(keep.to(tl.int32), 0)
    # F is settled when some known token is cut (every rule keeps a prefix of the order), or nothing is unknown.
    if top_k_known & ((n_keep < n_known) | (cut == float("-inf"))):
        score = tl.where(keep, x + gumbel(seed, offset + ids.to(tl.int64)), float("-inf"))
        winner = tl.sum(tl.where(position == tl.argmax(score, 0), ids, 0), 0)
        winner = tl.where(n_keep == 0, 0, winner)  # a row with no finite logit: token 0, as argmax gives
    else:
        floor_key = tl.where(top_k == 0, NO_BOUND, tl.where(top_k_known, order_key(kth), UNKNOWN_KEY))
        winner = winner_by_passes(row_logits, V, inv_temperature, best, top_k, floor_key, top_p, min_p, seed,
                                  offset, FALLBACK_BLOCK)
    return winner


def draw_numbers(vocab: int, greedy: bool, filtered: bool) -> int:
    """How many Philox numbers a row's draw may read, from its offset on (the caller advances the offset by this
    much): none for a greedy row, V rounded up to 4 for an unfiltered one (race_sample's draw), NOISE_ROUNDS times
    that for one with top-k, top-p or min-p."""
    if greedy:
        return 0
    return -(-vocab // 4) * 4 * (NOISE_ROUNDS if filtered else 1)


class FilteredSampler:
    """One launch of _filtered_kernel per call, with its scratch on one device, grown as batches grow: the per-row
    counts (zero between calls), each chunk's statistics and candidate ids; plus a pinned host buffer for the rows'
    keys and settings."""

    def __init__(self, device: torch.device, block_v: int | None = None, segment: int | None = None,
                 candidates: int | None = None, fallback_block: int | None = None):
        from . import INTERPRETED

        if device.type == "cuda" and device.index is None:  # tensors report cuda:N; compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.block_v = block_v or (INTERPRET_BLOCK_V if INTERPRETED else BLOCK_V)
        self.segment = segment or (INTERPRET_SEGMENT if INTERPRETED else SEGMENT)
        self.candidates = candidates or (INTERPRET_CANDIDATES if INTERPRETED else CANDIDATES)
        self.fallback_block = fallback_block or (INTERPRET_FALLBACK_BLOCK if INTERPRETED else FALLBACK_BLOCK)
        if self.block_v % self.segment:
            raise ValueError(f"block_v ({self.block_v}) must be a multiple of segment ({self.segment}).")
        self._done = torch.zeros(0, dtype=torch.int32, device=device)
        self._chunk_floats = torch.empty(0, dtype=torch.float32, device=device)
        self._chunk_ints = torch.empty(0, dtype=torch.int32, device=device)
        self._candidates = torch.empty(0, dtype=torch.int32, device=device)
        self._staging = torch.empty(0, dtype=torch.int64)
        self._uploaded = torch.empty(0, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def chunks(self, vocab: int) -> int:
        """Programs per row: runs of `segment` ids, dealt out `block_v // segment` to a program."""
        return triton.cdiv(triton.cdiv(vocab, self.segment), self.block_v // self.segment)

    def __call__(self, logits: torch.Tensor, temperatures: Sequence[float], top_k: Sequence[int],
                 top_p: Sequence[float], min_p: Sequence[float], seeds: Sequence[int],
                 offsets: Sequence[int]) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64. Per row: a temperature (0: greedy, the argmax, lowest id
        first), top_k (0 or >= V: off), top_p in (0, 1] (1: off), min_p in [0, 1] (0: off), and the Philox key
        (seeds[row], offsets[row]); row r reads numbers offsets[r] to offsets[r] + draw_numbers(...) - 1."""
        rows, vocab = logits.shape
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.device != self.device:
            raise ValueError(f"filtered_sample takes float32 logits [B, V] with contiguous rows on {self.device}; "
                             f"got {logits.dtype} {tuple(logits.shape)} with strides {logits.stride()} on "
                             f"{logits.device}.")
        settings = (temperatures, top_k, top_p, min_p, seeds, offsets)
        if any(len(values) != rows for values in settings):
            raise ValueError(f"filtered_sample needs a temperature, top_k, top_p, min_p, seed and offset per row; "
                             f"got {[len(values) for values in settings]} for {rows} rows.")
        # Each distinct value once (a batch's rows mostly share their settings), then a row at a time only to
        # name the bad one. NaN fails every comparison, so it is refused too.
        if not (all(0 <= t < float("inf") for t in set(temperatures)) and all(k >= 0 for k in set(top_k))
                and all(0 < p <= 1 for p in set(top_p)) and all(0 <= m <= 1 for m in set(min_p))):
            row = next(row for row in range(rows) if not (0 <= temperatures[row] < float("inf") and top_k[row] >= 0
                                                          and 0 < top_p[row] <= 1 and 0 <= min_p[row] <= 1))
            raise ValueError(f"filtered_sample needs per row a temperature >= 0, top_k >= 0, top_p in (0, 1] and "
                             f"min_p in [0, 1]; row {row} has {temperatures[row]}, {top_k[row]}, {top_p[row]}, "
                             f"{min_p[row]}.")
        chunks = self.chunks(vocab)
        self._grow(rows, chunks)
        keys, knobs = self._upload(vocab, *settings)
        count = rows * chunks
        floats, ints = self._chunk_floats, self._chunk_ints
        tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
        _filtered_kernel[(rows, chunks)](
            logits, keys, knobs, floats[:count], floats[count: 2 * count], floats[2 * count: 3 * count],
            ints[:count], floats[3 * count: 4 * count], ints[count: 2 * count], self._candidates, self._done, tokens,
            vocab, logits.stride(0), chunks, BLOCK_V=self.block_v, SEGMENT=self.segment, CANDIDATES=self.candidates,
            CANDIDATES_POW2=triton.next_power_of_2(chunks * self.candidates),
            CHUNKS_POW2=triton.next_power_of_2(chunks), LADDER=LADDER, FALLBACK_BLOCK=self.fallback_block,
            num_warps=NUM_WARPS, **pdl_arguments(logits))
        return tokens

    def _grow(self, rows: int, chunks: int) -> None:
        if len(self._done) < rows:
            self._done = torch.zeros(max(rows, 2 * len(self._done), 64), dtype=torch.int32, device=self.device)
        if len(self._chunk_floats) < 4 * rows * chunks:
            size = max(rows * chunks, len(self._chunk_floats) // 2)
            self._chunk_floats = torch.empty(4 * size, dtype=torch.float32, device=self.device)
            self._chunk_ints = torch.empty(2 * size, dtype=torch.int32, device=self.device)
            self._candidates = torch.empty(size * self.candidates, dtype=torch.int32, device=self.device)

    def _upload(self, vocab: int, temperatures, top_k, top_p, min_p, seeds, offsets
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (seed, offset, top_k) as int64 [B, 3] and (1 / temperature, top_p, min_p, 0) as float32
        [B, 4], on the device in one copy through a pinned buffer rewritten only once its last copy ran (the
        pattern of ForwardGraphs._upload's staging buffer)."""
        rows = len(seeds)
        words = 5 * rows  # 3 int64 and 4 float32 a row
        if self.device.type == "cuda":
            self._copied.synchronize()  # the last copy out of the pinned buffer has run: rewrite or replace it
        if len(self._staging) < words:
            self._staging = torch.empty(max(words, 640), dtype=torch.int64)
            if self.device.type == "cuda":
                self._staging = self._staging.pin_memory()
            self._uploaded = torch.empty(len(self._staging), dtype=torch.int64, device=self.device)
        host = self._staging.numpy()
        ints = host[: 3 * rows].reshape(rows, 3)
        ints[:, 0], ints[:, 1] = seeds, offsets
        ints[:, 2] = [k if k < vocab else 0 for k in top_k]
        floats = host[3 * rows: words].view("float32").reshape(rows, 4)
        floats[:, 0] = [1.0 / t if t > 0 else 0.0 for t in temperatures]
        floats[:, 1], floats[:, 2], floats[:, 3] = top_p, min_p, 0.0
        if self.device.type == "cuda":
            self._uploaded[:words].copy_(self._staging[:words], non_blocking=True)
            self._copied.record()
        else:
            self._uploaded[:words].copy_(self._staging[:words])
        return self._uploaded[: 3 * rows], self._uploaded[3 * rows: words].view(torch.float32)
