"""A torch model of kernels/filtered_sample.py's draw, for its tests: the same Philox numbers (drawn here through
tl.rand, in the interpreter on a CPU), the filtered set from sampling.filter_probs (the torch path), and the
rejection rounds of kernels/filtered_passes.py. Token for token, the kernel must draw what this model draws."""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dendrite_nb.kernels.filtered_passes import NOISE_ROUNDS
from dendrite_nb.sampling import SamplingParams, filter_probs

NEG_INF = float("-inf")
REJECTIONS = NOISE_ROUNDS - 1  # verified races before the bisection


@triton.jit
def _uniforms(offsets_ptr, out_ptr, seed, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.rand(seed, tl.load(offsets_ptr + i, mask=i < N, other=0)), mask=i < N)


def gumbel_noise(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """-log(-log(1 - u)) for u = tl.rand(seed, offsets) (int64 offsets, any shape, on any device): the kernels'
    noise. Drawn on the GPU when there is one (Triton runs CPU tensors only in its interpreter)."""
    flat = offsets.reshape(-1).to("cuda" if torch.cuda.is_available() else offsets.device).contiguous()
    uniforms = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    block = min(triton.next_power_of_2(max(len(flat), 1)), 1 << 16)
    _uniforms[(triton.cdiv(len(flat), block),)](flat, uniforms, seed, len(flat), BLOCK=block)
    return (-torch.log(-torch.log(1.0 - uniforms))).reshape(offsets.shape).to(offsets.device)


def stride(vocab: int) -> int:
    """Philox numbers between a draw's noise rounds: the vocabulary rounded up to 4."""
    return -(-vocab // 4) * 4


def round_noise(seed: int, offset: int, vocab: int, device: torch.device | str = "cpu"
                ) -> Callable[[int], torch.Tensor]:
    """noise(r) -> the Gumbel noise [vocab] of race r of a draw keyed (seed, offset)."""
    return lambda r: gumbel_noise(seed, offset + r * stride(vocab) + torch.arange(vocab, device=device))


def scaled(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """x = logits / T as the kernel computes it: times 1 / T rounded to float32."""
    return row * torch.tensor(1.0 / temperature, dtype=torch.float32, device=row.device)


def kept(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered set F [vocab] bool of one row, by the torch path."""
    return filter_probs(row[None], params)[0] > 0


def race(x: torch.Tensor, allowed: torch.Tensor, noise: torch.Tensor) -> int:
    return int(torch.where(allowed, x + noise, torch.full_like(x, NEG_INF)).argmax())


def model_token(row: torch.Tensor, params: SamplingParams, noise: Callable[[int], torch.Tensor],
                settled: bool) -> tuple[int, str]:
    """(token, how) for one row. settled: whether the kernel's step 2 settles F from its candidates (a test knows by
    construction); how: "greedy", "race" (unfiltered or settled: the race over F with round 0's noise), "round r"
    (step 3 accepted race r) or "bisection" (step 3's rejections all failed)."""
    if params.greedy:
        return int(row.argmax()), "greedy"
    x = scaled(row, params.temperature)
    top_k = params.top_k if params.top_k < len(row) else 0
    if settled or not params.filtered or (not top_k and params.top_p >= 1.0 and params.min_p <= 0.0):
        return race(x, kept(row, params) if params.filtered else x > NEG_INF, noise(0)), "race"
    best = x.max()
    prob = torch.where(x > NEG_INF, torch.exp(x - best), torch.zeros_like(x))
    order = torch.sort(-x, stable=True).indices  # the row's order: x down, then id up
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(row), device=row.device)
    in_top_k = x >= (torch.topk(x, top_k).values[-1] if top_k else NEG_INF)
    candidates = in_top_k & (x > NEG_INF) & (prob >= params.min_p)
    winner = race(x, candidates, noise(0))
    if params.top_p >= 1.0:
        return winner, "round 0"
    target = params.top_p * prob[in_top_k].sum()
    for r in range(1, REJECTIONS + 1):
        if prob[rank < rank[winner]].sum() < target:
            return winner, f"round {r - 1}"
        candidates = candidates & (rank < rank[winner])
        winner = race(x, candidates, noise(r))
    return race(x, kept(row, params), noise(REJECTIONS)), "bisection"
