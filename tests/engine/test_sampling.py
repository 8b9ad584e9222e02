"""Sampling: each knob does what it says, seeds make runs reproducible, EOS and stop strings end a branch."""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.sampling import apply_repetition_penalty, sample

PROMPT = "Once upon a time, in a forest of branching paths,"


@pytest.fixture
def eng(checkpoint):
    return Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4)


def greedy_run(eng, name, steps):
    branch = eng.new_branch(name, PROMPT)
    return eng.generate([branch], steps, SamplingParams(temperature=0.0, ignore_eos=True))[0]


def test_top_k_one_and_tiny_top_p_are_greedy(eng):
    greedy = greedy_run(eng, "greedy", 12)
    for params in (SamplingParams(temperature=1.5, top_k=1, ignore_eos=True),
                   SamplingParams(temperature=1.5, top_p=1e-6, ignore_eos=True)):
        branch = eng.new_branch(f"b{params.top_k}", PROMPT)
        assert eng.generate([branch], 12, params)[0] == greedy


def test_seeded_sampling_is_reproducible_and_branch_specific(eng):
    params = SamplingParams(temperature=1.0, seed=7, ignore_eos=True)
    first = eng.generate([eng.new_branch("x", PROMPT)], 16, params)[0]
    eng.prune("x")
    again = eng.generate([eng.new_branch("x", PROMPT)], 16, params)[0]
    other = eng.generate([eng.new_branch("y", PROMPT)], 16, params)[0]
    assert first == again and first != other


def test_sampling_follows_the_softmax_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits / 0.7, dim=-1)[0]
    generator = torch.Generator().manual_seed(3)
    draws = torch.stack([sample(logits, SamplingParams(temperature=0.7), [generator]) for _ in range(20000)])
    frequencies = torch.bincount(draws.flatten(), minlength=5).float() / 20000
    assert (frequencies - probs).abs().max() < 0.015


def test_exponential_noise_is_finite_and_positive_even_where_the_uniform_draw_is_zero():
    """Exp(1) is drawn as -log(u); uniform_ returns exactly 0 about once in 2^24 draws (seed 1 does, in row 1
    below), which unclamped gives inf: a token whose probability is its row's only mass would then score 0 / inf
    and lose to index 0."""
    from dendrite_nb.sampling import SMALLEST_UNIFORM, exponential_noise

    generator = torch.Generator().manual_seed(1)
    like = torch.empty(4, 151_936 * 16)
    uniform, replay = torch.empty_like(like), torch.Generator().manual_seed(1)  # the same draws, kept
    for row in range(4):
        uniform[row].uniform_(generator=replay)
    assert (uniform == 0).any()  # the case this test is for occurs in these draws
    noise = exponential_noise(like, [generator] * 4)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert noise[uniform == 0].eq(-torch.log(torch.tensor(SMALLEST_UNIFORM))).all()


def test_the_cpu_race_row_by_row_draws_what_one_batched_pass_draws():
    """On a CPU exponential_race works row by row (cache locality); the batched pass the GPU takes must give the
    same tokens from the same generators, so a seed means the same tokens either way."""
    from dendrite_nb.sampling import exponential_noise, exponential_race

    probs = torch.softmax(torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    row_by_row = exponential_race(probs, [torch.Generator().manual_seed(seed) for seed in range(6)])
    generators = [torch.Generator().manual_seed(seed) for seed in range(6)]
    batched = (probs / exponential_noise(probs, generators)).argmax(dim=-1)
    assert torch.equal(row_by_row, batched)
    assert len(set(row_by_row.tolist())) > 1  # the rows drew from their own generators


def test_top_k_and_top_p_never_sample_cut_tokens():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, -6.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    top_k = {int(sample(logits, SamplingParams(top_k=3), [generator])) for _ in range(500)}
    assert top_k == {0, 1, 2}
    probs = torch.softmax(logits, dim=-1)[0]  # top three hold ~0.94 of the mass; 0.9 keeps exactly them
    assert probs[:3].sum() > 0.9 > probs[:2].sum()
    top_p = {int(sample(logits, SamplingParams(top_p=0.9), [generator])) for _ in range(500)}
    assert top_p == {0, 1, 2}


def test_min_p_cuts_tokens_under_its_share_of_the_best_and_one_keeps_only_the_best():
    logits = torch.tensor([[3.0, 2.9, 1.0, -5.0, 2.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    kept = probs >= 0.3 * probs.max()  # 0, 1 and 4: 2.0 is e^-1 = 0.37 of the best, 1.0 is 0.14
    assert kept.tolist() == [True, True, False, False, True, False]
    generator = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, SamplingParams(min_p=0.3), [generator])) for _ in range(500)}
    assert drawn == {0, 1, 4}
    assert {int(sample(logits, SamplingParams(min_p=1.0), [generator])) for _ in range(50)} == {0}


def test_the_cuts_apply_in_transformers_order():
    """filter_probs keeps what transformers' warpers keep, in its order: temperature, top-k, top-p, min-p. Here
    vLLM's order (min-p before top-p) would keep fewer: top-p would measure within the min-p set."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from dendrite_nb.sampling import filter_probs

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 2
    for params in (SamplingParams(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05),
                   SamplingParams(temperature=1.3, top_p=0.5, min_p=0.2), SamplingParams(top_k=7, min_p=0.4)):
        warped = logits.clone()
        for warper in (TemperatureLogitsWarper(params.temperature), TopKLogitsWarper(params.top_k or 300),
                       TopPLogitsWarper(params.top_p), MinPLogitsWarper(params.min_p)):
            warped = warper(None, warped)
        assert torch.equal(filter_probs(logits, params) > 0, warped > float("-inf"))
    # Three likely tokens (0.2, 0.19, 0.18) and a tail of 43 at 0.01, under min-p 0.5's 0.1: top-p 0.5 keeps the
    # three (0.39 before the third); measured within the min-p set (0.35, 0.33, 0.32), it would keep two.
    x = torch.tensor([[0.2, 0.19, 0.18] + [0.01] * 43]).log()
    within_min_p = torch.tensor([0.2, 0.19, 0.18]) / 0.57
    assert (filter_probs(x, SamplingParams(top_p=0.5, min_p=0.5)) > 0).sum() == 3
    assert (within_min_p.cumsum(-1) - within_min_p < 0.5).sum() == 2


def test_mixed_rows_sample_as_each_would_alone():
    """sample_rows (rows that joined a running batch with their own settings) draws each row as sample() would
    draw it alone from the same generator state; greedy rows need no generator."""
    from dendrite_nb.sampling import sample_rows

    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(top_p=0.8), SamplingParams(temperature=0.0), SamplingParams(top_k=3, min_p=0.1),
              SamplingParams(top_p=0.8), SamplingParams(temperature=0.5, repetition_penalty=1.5)]
    histories = [[], [], [], [], [1, 2, 3]]
    generators = [torch.Generator().manual_seed(seed) if not p.greedy else None for seed, p in enumerate(params)]
    mixed = sample_rows(logits, params, generators, histories).tolist()
    for row, p in enumerate(params):
        generator = None if p.greedy else torch.Generator().manual_seed(row)
        alone = sample(logits[row: row + 1], p, [generator], histories[row: row + 1])
        assert mixed[row] == int(alone)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(2, 50)
    histories = [[1, 5, 5, 7], [0, 49]]
    ours = apply_repetition_penalty(logits.clone(), histories, 1.3)
    processor = RepetitionPenaltyLogitsProcessor(1.3)
    theirs = torch.cat([processor(torch.tensor([h]), logits[i: i + 1].clone()) for i, h in enumerate(histories)])
    assert torch.equal(ours, theirs)


def test_extreme_temperatures_and_penalties_never_sample_nan():
    """A temperature of 1e-45 or a penalty of 1e-30 overflowed float32 to inf, and the softmax to NaN, whose
    argmax is whatever token NaN landed on. Tiny temperatures now draw the argmax; extreme penalties saturate."""
    logits = torch.tensor([[0.0, 3.0, -2.0, 1.0, 2.5, float("-inf")]])
    generator = torch.Generator().manual_seed(0)
    for temperature in (1e-45, 1e-30, 1e-21):
        params = SamplingParams(temperature=temperature)
        assert params.greedy
        assert [int(sample(logits, params, [generator])) for _ in range(20)] == [1] * 20
    assert not SamplingParams(temperature=1e-20).greedy
    for penalty in (1e-300, 1e-30, 1e30, 1e300):
        penalized = apply_repetition_penalty(logits.clone(), [[0, 1, 2, 5]], penalty)
        assert not penalized.isnan().any() and penalized[0, 5] == float("-inf")
        assert penalized[0, :5].isfinite().all()
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, repetition_penalty=penalty)
            token = int(sample(logits, params, [generator], [[0, 1, 2, 5]]))
            assert token == (1 if penalty < 1 else 4) or temperature > 0 and token in range(5)
    with pytest.raises(ValueError, match="repetition_penalty must be finite"):
        SamplingParams(repetition_penalty=float("inf"))


def test_repetition_penalty_changes_greedy_choice(eng):
    plain = greedy_run(eng, "plain", 24)
    branch = eng.new_branch("penalised", PROMPT)
    penalised = eng.generate([branch], 24, SamplingParams(temperature=0.0, repetition_penalty=5.0, ignore_eos=True))[0]
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_eos_ends_a_branch_unless_ignored(eng):
    greedy = greedy_run(eng, "ref", 10)
    eng.eos_token_ids = frozenset({greedy[3]})  # pretend the fourth greedy token is the end token
    stop_at = greedy.index(greedy[3]) + 1
    branch = eng.new_branch("eos", PROMPT)
    assert eng.generate([branch], 10, SamplingParams(temperature=0.0))[0] == greedy[:stop_at]
    ignoring = eng.new_branch("ignoring", PROMPT)
    assert eng.generate([ignoring], 10, SamplingParams(temperature=0.0, ignore_eos=True))[0] == greedy


def test_stop_string_ends_a_branch_keeping_the_completing_token(eng):
    greedy = greedy_run(eng, "ref", 24)
    text = eng.decode(greedy)
    stop = text[10:13]
    branch = eng.new_branch("stopper", PROMPT)
    out = eng.generate([branch], 24, SamplingParams(temperature=0.0, stop=stop, ignore_eos=True))[0]
    assert out == greedy[: len(out)] and len(out) < 24
    assert stop in eng.decode(out) and stop not in eng.decode(out[:-1])


def test_finished_branches_leave_the_batch_others_continue(eng):
    greedy = greedy_run(eng, "ref", 8)
    eng.eos_token_ids = frozenset({greedy[1]})
    a = eng.new_branch("a", PROMPT)
    b = eng.new_branch("b", "Something else entirely")
    outs = eng.generate([a, b], 8, SamplingParams(temperature=0.0))
    assert outs[0] == greedy[: greedy.index(greedy[1]) + 1]
    assert len(outs[1]) == 8 or outs[1][-1] == greedy[1]
    eng.audit()


def test_a_greedy_call_makes_no_generator_and_changes_no_later_draw(eng):
    """Unseeded greedy steps draw no noise, so they leave a branch's generator unmade. Made later, at the first
    sampled step, it is in the state it would have had if made before them: the later tokens are the same."""
    lazy = eng.new_branch("lazy", "The cat", seed=7)
    eager = eng.new_branch("eager", "The cat", seed=7)
    eager.sampler(eng._journal, None, eng.device)  # what every call did before: the generator made whatever the sampling
    eng.generate([lazy, eager], 3, SamplingParams(temperature=0.0, ignore_eos=True))
    assert lazy.generator is None and eager.generator is not None
    sampled = eng.generate([lazy, eager], 6, SamplingParams(temperature=1.0, ignore_eos=True))
    assert sampled[0] == sampled[1] and lazy.generator is not None
    seeded = eng.new_branch("seeded", "The cat", seed=7)
    eng.generate([seeded], 2, SamplingParams(temperature=0.0, seed=3, ignore_eos=True))
    assert seeded.generator is not None  # a seeded call re-seeds the generator, greedy or not
