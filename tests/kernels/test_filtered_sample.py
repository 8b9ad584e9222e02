"""The fused filtered sampler (kernels/filtered_sample.py): temperature, top-k, top-p and min-p, each row with its
own settings. Token for token it draws what tests/support/filtered_sampling.py's model draws from the same Philox
numbers: the race over the torch path's filtered set when step 2 settles it, the rejection rounds of step 3
otherwise; the model's rounds follow the filtered distribution; a row's draw depends on its key alone. On the CPU
the kernel runs in Triton's interpreter with chunks of 16 ids and 4 (or 16) candidates a chunk, so tiny
vocabularies cross chunks and reach step 3; the gpu tests add a large sample and the engine's use of it."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before the imports below

pytest.importorskip("triton")

from dendrite_nb import Engine, SamplingParams  # noqa: E402
from dendrite_nb import sampling as sampling_module  # noqa: E402
from dendrite_nb.kernels.filtered_passes import NOISE_ROUNDS  # noqa: E402
from dendrite_nb.kernels.filtered_sample import FilteredSampler, draw_numbers  # noqa: E402
from dendrite_nb.kernels.race_sample import RaceSampler  # noqa: E402
from dendrite_nb.sampling import filter_probs  # noqa: E402
from tests.support.filtered_sampling import gumbel_noise, model_token, round_noise, stride  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")
SETTLING = dict(block_v=16, segment=4, candidates=16)  # a chunk keeps all its tokens: step 2 settles every row
CROWDED = dict(block_v=16, segment=4, candidates=4)  # at most 4 a chunk: large sets go on to step 3


def draw(sampler: FilteredSampler, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
         offsets: list[int]) -> list[int]:
    """One launch over the rows, each with its own settings (a greedy row as temperature 0)."""
    return sampler(logits.to(DEVICE), [0.0 if p.greedy else p.temperature for p in params], [p.top_k for p in params],
                   [p.top_p for p in params], [p.min_p for p in params], seeds, offsets).tolist()


def modelled(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], offsets: list[int],
             settled: bool) -> list[tuple[int, str]]:
    return [model_token(logits[row], params[row], round_noise(seeds[row], offsets[row], logits.shape[1]), settled)
            for row in range(len(params))]


# Settings that exercise each rule and their mixes (temperatures are powers of 2: x = logits / T is then exact,
# as the kernel's logits * (1 / T) is, so the torch path's set is the kernel's to the last bit).
SETTINGS = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_k=3),
            SamplingParams(temperature=0.5, top_p=0.7), SamplingParams(temperature=1.0, top_p=1e-6),
            SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=2.0, min_p=1.0),
            SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
            SamplingParams(temperature=0.5, top_k=12, top_p=0.95), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.0, top_k=4)]


@pytest.mark.parametrize("vocab, shape", [(7, "distinct"), (37, "ties"), (61, "masked")])
def test_settled_rows_draw_the_race_over_the_torch_filtered_set(vocab, shape):
    """Mixed settings in one launch: each row's token is the argmax of x + noise over the set filter_probs keeps."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(SETTINGS), vocab, generator=generator) * 3
    if shape == "ties":
        logits = logits.round()
    if shape == "masked":  # a grammar's refusals; the first token stays allowed
        logits[:, 1:][torch.rand(len(SETTINGS), vocab - 1, generator=generator) < 0.5] = -INF
    seeds, offsets = list(range(100, 100 + len(SETTINGS))), [4 * vocab * row for row in range(len(SETTINGS))]
    tokens = draw(FilteredSampler(DEVICE, **SETTLING), logits, SETTINGS, seeds, offsets)
    expected = modelled(logits, SETTINGS, seeds, offsets, settled=True)
    assert tokens == [token for token, _ in expected]
    for row, params in enumerate(SETTINGS):
        assert params.greedy or filter_probs(logits[row: row + 1], params)[0, tokens[row]] > 0


def test_rows_past_the_candidates_take_the_rejection_rounds_or_the_bisection():
    """Sets larger than the chunks keep (or ties crowding every chunk) go to step 3: its rejection rounds and,
    when they all reject, its bisection, draw what the model draws; passes cross blocks of 16 ids here."""
    vocab = 48
    flat = torch.zeros(vocab)  # every chunk's 16 ties crowd out its 4 candidates: nothing is known
    tilted = torch.linspace(1.0, -1.0, vocab)  # a nucleus of dozens of tokens, more than 4 chunks x 4
    rows = [(flat, SamplingParams(top_p=p)) for p in (0.05, 0.13, 0.21, 0.29, 0.37)]
    rows += [(tilted, SamplingParams(top_p=0.9)), (tilted, SamplingParams(top_p=0.6, min_p=0.3)),
             (flat, SamplingParams(top_k=30, top_p=0.5)), (tilted, SamplingParams(top_k=40, min_p=0.5))]
    logits = torch.stack([row for row, _ in rows])
    params = [p for _, p in rows]
    seeds, offsets = list(range(len(rows))), [8 * NOISE_ROUNDS * vocab] * len(rows)
    tokens = draw(FilteredSampler(DEVICE, **CROWDED, fallback_block=16), logits, params, seeds, offsets)
    expected = modelled(logits, params, seeds, offsets, settled=False)
    assert tokens == [token for token, _ in expected]
    assert {"round 0", "round 1", "round 2", "bisection"} <= {how for _, how in expected}


def test_top_k_past_the_candidates_is_found_with_all_its_ties():
    """k beyond what the chunks keep: the k-th largest key by radix select; ties at it are all kept, and the
    top-p mass is over that set."""
    vocab = 64
    logits = (torch.arange(vocab) % 7).float().flip(0)[None].repeat(4, 1)  # 9 or 10 tokens of each value
    params = [SamplingParams(top_k=25), SamplingParams(top_k=25, top_p=0.4), SamplingParams(top_k=40, min_p=0.1),
              SamplingParams(temperature=0.5, top_k=17, top_p=0.9)]
    seeds, offsets = [7, 8, 9, 10], [0, 0, 0, 0]
    tokens = draw(FilteredSampler(DEVICE, **CROWDED), logits, params, seeds, offsets)
    assert tokens == [token for token, _ in modelled(logits, params, seeds, offsets, settled=False)]
    kept = filter_probs(logits[:1], params[0])[0] > 0
    assert kept.sum() == 27 and kept[logits[0] == 4.0].all()  # the 25th largest is a 4; the two 4s after it stay


def test_edge_cases_draw_only_what_the_rules_keep():
    sampler = FilteredSampler(DEVICE, **CROWDED)
    vocab = 40
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    logits[:, 21] = 9.0  # a clear best token
    logits[4] = -INF
    logits[4, 39] = -80.0  # the row's only allowed token, however unlikely
    logits[5] = -200.0
    logits[5, 2] = 0.0  # all of the row's mass on one token (the others underflow to 0)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0),
              SamplingParams(top_k=1, temperature=8.0), SamplingParams(top_p=0.5, min_p=0.5),
              SamplingParams(top_p=0.999)]
    for seed in range(3):
        tokens = draw(sampler, logits, params, [seed] * 6, [0] * 6)
        assert tokens == [21, 21, 21, 21, 39, 2]
    masked = torch.full((1, vocab), -INF)
    assert draw(sampler, masked, [SamplingParams(top_p=0.9)], [1], [0]) == [0]  # nothing allowed: token 0, as argmax


def test_unfiltered_rows_draw_what_race_sample_draws_and_greedy_rows_the_argmax():
    """A row without cuts races as kernels/race_sample.py does (the same numbers, the same token), so a branch
    draws the same whether its batch is mixed (one fused launch) or not; a greedy row takes the first best id."""
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[3, [4, 17, 33]] = 5.0  # three-way tie for the best
    seeds, offsets = [11, 12, 13, 14, 15, 16], [0, 52, 104, 0, 52, 104]
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3)] + [SamplingParams(temperature=0.0)] * 3
    tokens = draw(FilteredSampler(DEVICE, **CROWDED), logits, params, seeds, offsets)
    race = RaceSampler(DEVICE, block_v=16)
    for row in range(3):
        assert tokens[row] == race(logits[row: row + 1].to(DEVICE), params[row].temperature, seeds[row: row + 1],
                                   offsets[row: row + 1]).item()
    assert tokens[3:] == [4] + logits[4:].argmax(dim=1).tolist()


def test_a_rows_token_depends_on_its_key_alone():
    """The same row alone, first or last among others with other settings, and again (the counts were reset)."""
    vocab = 45
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)) * 2
    params = [SamplingParams(top_p=0.8), SamplingParams(top_k=3), SamplingParams(temperature=0.0),
              SamplingParams(min_p=0.1, temperature=2.0), SamplingParams(temperature=0.5)]
    seeds, offsets = [5, 6, 7, 8, 9], [0, 400, 800, 1200, 1600]
    sampler = FilteredSampler(DEVICE, **CROWDED)
    together = draw(sampler, logits, params, seeds, offsets)
    assert draw(sampler, logits, params, seeds, offsets) == together
    for row in (0, 3):
        assert draw(sampler, logits[row: row + 1], params[row: row + 1], seeds[row: row + 1],
                    offsets[row: row + 1]) == [together[row]]
    reordered = draw(sampler, logits.flip(0), params[::-1], seeds[::-1], offsets[::-1])
    assert reordered[::-1] == together
    moved = draw(sampler, logits, params, seeds, [offset + NOISE_ROUNDS * stride(vocab) for offset in offsets])
    assert moved != together  # fresh numbers past the offset (5 rows of 45 tokens: the same 5 draws is ~0)


def test_settled_draws_follow_the_filtered_distribution():
    """120 draws, one a row, each from its own offset: a fixed sample (Philox is deterministic), within 0.14 of
    the filtered softmax in every cell, over 3 standard deviations of the largest cell."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -2.0, 0.2])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.85, min_p=0.2)
    probs = filter_probs(logits[None], params)[0]
    rows = 120
    tokens = draw(FilteredSampler(DEVICE, **SETTLING), logits.repeat(rows, 1), [params] * rows, [3] * rows,
                  [NOISE_ROUNDS * 8 * row for row in range(rows)])
    frequencies = torch.bincount(torch.tensor(tokens), minlength=8).float() / rows
    assert (frequencies - probs / probs.sum()).abs().max() < 0.14
    assert set(tokens) == set(probs.nonzero().flatten().tolist())  # the three kept tokens, and only they


def test_the_rejection_rounds_draw_the_filtered_distribution():
    """The model of step 3 (which the kernel matches token for token, above) over 4,000 draws of the kernel's
    own noise: rejection rounds and bisection together follow the filtered softmax (total variation under 0.03,
    about 3 standard errors here; the sample is fixed)."""
    vocab, draws = 24, 4000
    logits = torch.linspace(1.5, -1.5, vocab)
    params = SamplingParams(top_p=0.3, min_p=0.2)
    probs = filter_probs(logits[None], params)[0]
    offsets = torch.arange(draws)[:, None, None] * NOISE_ROUNDS * stride(vocab) \
        + torch.arange(NOISE_ROUNDS)[None, :, None] * stride(vocab) + torch.arange(vocab)
    noise = gumbel_noise(17, offsets)  # [draws, rounds, vocab]
    drawn = [model_token(logits, params, lambda r, d=d: noise[d, r], settled=False) for d in range(draws)]
    frequencies = torch.bincount(torch.tensor([token for token, _ in drawn]), minlength=vocab).float() / draws
    assert (frequencies - probs / probs.sum()).abs().sum() / 2 < 0.03
    paths = [how for _, how in drawn]
    assert paths.count("round 0") < draws and paths.count("round 1") and paths.count("bisection")


def test_each_draw_moves_its_generator_past_the_numbers_it_may_read():
    """filtered_on_device keys each row by its generator and advances the offset: by the vocabulary rounded up to
    4 for an unfiltered row (as race_sample), NOISE_ROUNDS times that for a filtered one, not at all when greedy."""
    class Generator:  # the CUDA generator's Philox state, here where there is no CUDA
        def __init__(self, seed: int):
            self.seed, self.offset = seed, 8

        def initial_seed(self) -> int:
            return self.seed

        def get_offset(self) -> int:
            return self.offset

        def set_offset(self, offset: int) -> None:
            self.offset = offset

    vocab = 30
    params = [SamplingParams(temperature=0.9), SamplingParams(top_p=0.9), SamplingParams(temperature=0.0)]
    generators = [Generator(1), Generator(2), None]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    first = sampling_module.filtered_on_device(logits, params, generators).tolist()
    assert [g.offset for g in generators[:2]] == [8 + 32, 8 + NOISE_ROUNDS * 32]
    assert [draw_numbers(vocab, p.greedy, p.filtered) for p in params] == [32, NOISE_ROUNDS * 32, 0]
    assert first[2] == int(logits[2].argmax())
    tokens = draw(FilteredSampler(DEVICE), logits.cpu(), params, [1, 2, 0], [8, 8, 0])
    assert tokens == first  # the kernel read each row's key as it stood before the draw


def test_bad_arguments_raise_before_launching():
    sampler = FilteredSampler(DEVICE)
    logits = torch.zeros(2, 8, device=DEVICE)
    good = dict(temperatures=[1.0, 1.0], top_k=[0, 0], top_p=[0.9, 0.9], min_p=[0.0, 0.0], seeds=[1, 2],
                offsets=[0, 0])
    with pytest.raises(ValueError, match="float32 logits"):
        sampler(logits.double(), **good)
    with pytest.raises(ValueError, match="per row"):
        sampler(logits, **{**good, "seeds": [1]})
    for name, value in (("temperatures", [1.0, -1.0]), ("top_p", [0.9, 0.0]), ("min_p", [1.5, 0.0]),
                        ("top_k", [-1, 0]), ("temperatures", [1.0, float("nan")]), ("top_p", [float("nan"), 0.9])):
        with pytest.raises(ValueError, match="row [01] has"):
            sampler(logits, **{**good, name: value})
    with pytest.raises(ValueError, match="multiple of segment"):
        FilteredSampler(DEVICE, block_v=20, segment=8)


@pytest.mark.gpu
def test_a_large_sample_on_the_gpu_follows_the_filtered_distribution():
    rows = 50_000
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -2.0, 0.2])
    for params in (SamplingParams(temperature=0.8, top_k=4, top_p=0.85, min_p=0.2), SamplingParams(top_p=0.6)):
        generators = [torch.Generator(device="cuda").manual_seed(seed) for seed in range(rows)]
        tokens = sampling_module.sample(logits.repeat(rows, 1).cuda(), params, generators)
        probs = filter_probs(logits[None], params)[0]
        frequencies = torch.bincount(tokens.cpu(), minlength=8).float() / rows
        assert (frequencies - probs / probs.sum()).abs().max() < 0.01


@pytest.mark.gpu
def test_a_full_vocabulary_row_on_the_gpu_settles_or_passes_as_the_model_says():
    """At the default sizes (chunks of 4,096 ids, 32 candidates each), a 151,936-token vocabulary: top-k 50
    settles in step 2; top-p 0.9 over near-flat logits (a nucleus of most of the vocabulary) goes to step 3."""
    vocab = 151_936
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 0.1
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05), SamplingParams(top_p=0.9)]
    tokens = draw(FilteredSampler(DEVICE), logits, params, [1, 2], [0, 0])
    for row, settled in ((0, True), (1, False)):
        noise = round_noise([1, 2][row], 0, vocab, device="cuda")
        expected, _ = model_token(logits[row].cuda(), params[row], noise, settled)
        assert tokens[row] == expected


@pytest.mark.gpu
def test_the_engine_samples_filtered_rows_on_the_gpu_per_branch_whatever_the_batch(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=256, block_size=8)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, ignore_eos=True)
    trunk = eng.new_branch("trunk", "A tree of thought")
    kids = eng.fork(trunk, 4)
    together = eng.generate(kids, 10, params)
    assert any(device.type == "cuda" for device in sampling_module._filtered_samplers)  # the fused path ran
    vocab = eng.model.config.vocab_size
    assert all(kid.generator.get_offset() == 10 * draw_numbers(vocab, False, True) for kid in kids)
    eng.prune(kids)
    again = eng.fork(trunk, 4)  # the same names, so the same seeds
    one_at_a_time = eng.generate(again, 10, params, max_batch=1)
    assert one_at_a_time == together and len({tuple(t) for t in together}) == 4
