"""Sampling parameters and a batched sampler with one generator per branch.

Each row draws its noise from its own branch's generator, so a branch's tokens do not depend on what
else is in the batch. Sampling uses the exponential race (argmax of p / Exp(1)), which needs no
device-to-host sync per row; the caller syncs once per step to read the tokens. On a GPU the race runs
in one Triton launch: plain temperature sampling in kernels/race_sample.py, and any top-k, top-p or
min-p cut, with each row's own settings, in kernels/filtered_sample.py (no sort of the vocabulary).
Both take their noise from Philox keyed by each branch's CUDA generator (its seed and offset, which
each draw advances past the numbers it may read: the vocabulary's size, NOISE_ROUNDS times that with
a cut): the generator stays the branch's whole sampling state, as saved and restored.

The cuts, in HF transformers' order (its TemperatureLogitsWarper, TopK, TopP, then MinP): top-k keeps
every token whose logit is at least the k-th largest (ties at the k-th all kept); top-p then keeps, in
order of probability (equal ones by token id), each token whose mass before it, within the top-k set,
is under top_p; min-p last keeps tokens whose probability is at least min_p times the most likely
token's. min-p is a ratio to the best token, so it cuts the same before or after renormalising; vLLM
applies it before top-k and top-p, where top-p then measures its mass within the min-p set.
"""
from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import torch

SEED_LIMIT = 2**64  # a branch's seed is an int in [0, SEED_LIMIT), the range a torch generator keeps as it is
# Below this temperature a draw is the argmax: float32 logits 1e-6 apart (the finest gap near 10) are 1e14 apart
# once divided by it, so no other token keeps any probability; dividing by still smaller temperatures overflows
# float32 to inf and the softmax to NaN. So those temperatures sample greedily (ties go to the lowest id).
GREEDY_BELOW_TEMPERATURE = 1e-20


def check_seed(seed: object) -> None:
    """Raise ValueError unless `seed` can seed a branch's generator (a bool is not a seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}.")


def _number(value: object) -> bool:
    """A real number, and not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass kept; 1 means no cut
    min_p: float = 0.0  # keep tokens of at least this fraction of the most likely token's probability; 0: off
    repetition_penalty: float = 1.0  # HF semantics over the branch's whole context; 1 means off
    stop: tuple[str, ...] = ()  # stop once generated text contains any of these (the token is kept)
    seed: int | None = None  # reseed every branch of the call from (seed, branch name)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, Iterable):
            object.__setattr__(self, "stop", tuple(self.stop))
        problems = []
        if not (_number(self.temperature) and 0 <= self.temperature < float("inf")):
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            problems.append(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not (_number(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf")):
            problems.append(f"repetition_penalty must be finite and > 0 (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            problems.append(f"seed must be an int or None, got {self.seed!r}")   # hashed with each branch's name
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p may cut a token."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def derive_seed(base: int, name: str) -> int:
    """A stable 63-bit seed from a base seed and a branch name (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{base}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def apply_repetition_penalty(logits: torch.Tensor, histories: list[list[int]], penalty: float) -> torch.Tensor:
    """Divide positive logits and multiply negative ones of tokens already in each row's history.

    An extreme penalty (1e-30, 1e30) would overflow float32 to +-inf, and a row of infinities softmaxes to NaN:
    results are clamped to the dtype's finite range. A -inf logit (a constraint's refusal) stays -inf."""
    finfo = torch.finfo(logits.dtype)
    penalty = min(max(penalty, finfo.tiny), finfo.max)  # in float32 1e-300 would round to 0, and 0 / 0 is NaN
    for row, history in enumerate(histories):
        seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
        scores = logits[row, seen]
        penalized = torch.where(scores > 0, scores / penalty, scores * penalty).clamp(finfo.min, finfo.max)
        logits[row, seen] = torch.where(scores == float("-inf"), scores, penalized)
    return logits


_race_samplers: dict[torch.device, object] = {}  # kernels.race_sample.RaceSampler per CUDA device
_filtered_samplers: dict[torch.device, object] = {}  # kernels.filtered_sample.FilteredSampler per CUDA device


def _philox_keys(generators: list[torch.Generator | None], advances: list[int]) -> tuple[list[int], list[int]]:
    """Each row's Philox key, its generator's (seed, offset); the offset then moves past the numbers the row's draw
    may read (advances, multiples of 4 as CUDA generators require). A row that draws none (a greedy row of a mixed
    batch, whose generator may be None) keeps its generator as it was: key (0, 0)."""
    seeds, offsets = [], []
    for generator, advance in zip(generators, advances):
        if not advance:
            seeds.append(0)
            offsets.append(0)
            continue
        offset = generator.get_offset()
        seeds.append(generator.initial_seed() & 0x7FFF_FFFF_FFFF_FFFF)  # Philox keys by 64 bits; int64 holds 63
        offsets.append(offset)
        generator.set_offset(offset + advance)
    return seeds, offsets


def race_on_device(logits: torch.Tensor, temperature: float, generators: list[torch.Generator]) -> torch.Tensor:
    """The fused temperature race (one launch), each row keyed by its generator (_philox_keys), whose offset moves
    past the vocabulary's worth of numbers the row used (rounded to 4)."""
    from .kernels.race_sample import RaceSampler

    sampler = _race_samplers.get(logits.device)
    if sampler is None:
        sampler = _race_samplers[logits.device] = RaceSampler(logits.device)
    advances = [-(-logits.shape[1] // 4) * 4] * len(generators)
    return sampler(logits, temperature, *_philox_keys(generators, advances))


def filtered_on_device(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None]) -> torch.Tensor:
    """The fused filtered race (one launch), each row under its own settings and keyed by its generator, whose
    offset moves past the numbers the row's draw may read (kernels.filtered_sample.draw_numbers); a greedy row takes
    the argmax and draws nothing (its generator may be None)."""
    from .kernels.filtered_sample import FilteredSampler, draw_numbers

    sampler = _filtered_samplers.get(logits.device)
    if sampler is None:
        sampler = _filtered_samplers[logits.device] = FilteredSampler(logits.device)
    rows, first = len(params), params[0]
    # A batch's rows mostly share one setting: its numbers are then worked out once, not once a row (64 rows'
    # worth of attribute reads cost a host-bound step of a 0.6B model about a tenth of its time).
    if all(p is first for p in params):
        advances = [draw_numbers(logits.shape[1], first.greedy, first.filtered)] * rows
        settings = ([0.0 if first.greedy else first.temperature] * rows, [first.top_k] * rows,
                    [first.top_p] * rows, [first.min_p] * rows)
    else:
        advances = [draw_numbers(logits.shape[1], p.greedy, p.filtered) for p in params]
        settings = ([0.0 if p.greedy else p.temperature for p in params], [p.top_k for p in params],
                    [p.top_p for p in params], [p.min_p for p in params])
    return sampler(logits, *settings, *_philox_keys(generators, advances))


def sample(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator],
           histories: list[list[int]] | None = None) -> torch.Tensor:
    """logits [B, vocab] float32 -> token ids [B] (on the logits' device)."""
    if params.repetition_penalty != 1.0 and histories is not None:  # the penalty writes in place: copy first
        logits = apply_repetition_penalty(logits.clone(), histories, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda:
        if not params.filtered:
            return race_on_device(logits, params.temperature, generators)
        return filtered_on_device(logits, [params] * len(generators), generators)
    return exponential_race(filter_probs(logits, params), generators)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                histories: list[list[int]] | None = None) -> torch.Tensor:
    """sample() with each row's own settings (rows that joined a running batch bring theirs): logits [B, vocab]
    float32 -> token ids [B]. On a GPU one launch samples every row; elsewhere rows of equal settings sample
    together. A greedy row's generator may be None."""
    if len(set(params)) == 1:
        return sample(logits, params[0], generators, histories)
    if histories is not None and any(p.repetition_penalty != 1.0 for p in params):
        logits = logits.clone()  # the penalty writes in place
        for row, p in enumerate(params):
            if p.repetition_penalty != 1.0:
                apply_repetition_penalty(logits[row: row + 1], histories[row: row + 1], p.repetition_penalty)
    if all(p.greedy for p in params):  # rows that differ in stop strings or seeds only, say
        return logits.argmax(dim=-1)
    if logits.is_cuda:
        return filtered_on_device(logits, params, generators)
    groups: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p, []).append(row)
    sampled = torch.empty(len(params), dtype=torch.long, device=logits.device)
    for p, rows in groups.items():
        where = torch.tensor(rows, device=logits.device)
        sampled[where] = sample(logits.index_select(0, where), p, [generators[row] for row in rows])
    return sampled


def filter_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / temperature) [B, vocab] with the tokens top-k, top-p and min-p cut (in the module's
    order) set to 0; the rest are not renormalised (the race does not need it)."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:  # a stable sort: equal probabilities in id order, as the GPU kernel orders them
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


# Uniform draws are clamped to this before the log, so Exp(1) = -log(u) is finite (u = 0 would give inf, and a
# token whose probability is its row's only mass could then lose to 0 / inf); u < 1 keeps it above 0.
SMALLEST_UNIFORM = torch.finfo(torch.float32).tiny


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, normaliser: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits)[b, tokens[b]] for each row b of logits [B, vocab] -> [B], without writing the [B, vocab]
    log_softmax. normaliser: each row's logsumexp [B], when it had to be taken earlier (before a mask)."""
    if normaliser is None:
        normaliser = torch.logsumexp(logits, dim=-1)
    return logits.gather(1, tokens.view(-1, 1)).squeeze(1) - normaliser


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """argmax(p / E) of each row of probs [B, vocab], E ~ Exp(1) from the row's generator -> token ids [B].
    On a CPU it runs row by row, so that a row's noise, quotient and argmax stay in cache; whole-batch passes
    over 8 or 64 rows of a 151,936-token vocabulary go to memory and took 1.3-1.5x as long
    (benchmarks/cpu_sampling.py). On a GPU, one batched pass. Both draw the same tokens."""
    if probs.device.type != "cpu":
        return (probs / exponential_noise(probs, generators)).argmax(dim=-1)
    winners = torch.empty(len(generators), dtype=torch.long)
    noise, quotient = torch.empty(probs.shape[1]), torch.empty(probs.shape[1])
    for row, generator in enumerate(generators):
        torch.div(probs[row], _fill_exponential(noise, generator), out=quotient)
        winners[row] = quotient.argmax()
    return winners


def exponential_noise(like: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Exp(1) draws shaped like `like` [B, vocab], row b from generators[b]."""
    noise = torch.empty_like(like)
    for row, generator in enumerate(generators):
        _fill_exponential(noise[row], generator)
    return noise


def _fill_exponential(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """out filled in place with Exp(1) draws, as -log(u) of uniform u: on a CPU about 3x faster than
    Tensor.exponential_ (0.9 against 2.9 ms at a 151,936-token vocabulary, two cores: benchmarks/cpu_sampling.py),
    whose per-element sampling dominated a sampled step's host time."""
    return out.uniform_(generator=generator).clamp_min_(SMALLEST_UNIFORM).log_().neg_()
