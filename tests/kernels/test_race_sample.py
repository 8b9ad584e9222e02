"""The fused temperature sampler (kernels/race_sample.py): its draws follow softmax(logits / T), a masked token
never wins, the winner across chunks is the best of all, and a row's draw depends on its key alone. On the
CPU the kernel runs in Triton's interpreter (16-entry chunks, so small vocabularies cross several); the gpu
tests add a large sample and the engine's use of it."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before the import below

pytest.importorskip("triton")

from dendrite_nb import Engine, SamplingParams  # noqa: E402
from dendrite_nb import sampling as sampling_module  # noqa: E402
from dendrite_nb.kernels.race_sample import RaceSampler  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab).float() / len(tokens)


def test_draws_follow_the_tempered_softmax():
    rows = 600  # one draw a row, every row its own offset: 600 programs in the interpreter
    sampler = RaceSampler(DEVICE)
    tokens = sampler(LOGITS.repeat(rows, 1).to(DEVICE), 0.7, [3] * rows, [8 * row for row in range(rows)])
    # Philox is deterministic: this sample is fixed, and 0.05 is over 3 standard deviations of the largest cell.
    assert (frequencies(tokens, 5) - torch.softmax(LOGITS / 0.7, 0)).abs().max() < 0.05


def test_masked_tokens_never_win_and_a_single_allowed_token_always_does():
    rows, vocab = 200, 40  # three chunks of 16 in the interpreter
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, 5], logits[:, 33] = 0.0, 0.3  # two allowed tokens in different chunks
    logits[0] = float("-inf")
    logits[0, 39] = -80.0  # the only allowed token of row 0, however unlikely its logit
    tokens = RaceSampler(DEVICE)(logits.to(DEVICE), 1.0, list(range(rows)), [0] * rows).cpu()
    assert tokens[0] == 39
    assert set(tokens[1:].tolist()) == {5, 33}


def test_the_winner_is_the_best_chunk_best_at_a_low_temperature():
    vocab = 100  # seven chunks, the last one partial
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    for row, winner in enumerate((0, 17, 95, 99)):  # first entry, a middle chunk, the partial chunk, its end
        logits[row, winner] = 10.0
    tokens = RaceSampler(DEVICE)(logits.to(DEVICE), 1e-3, [1, 2, 3, 4], [0, 0, 0, 0])
    assert tokens.tolist() == [0, 17, 95, 99]


def test_a_rows_draw_depends_on_its_key_alone_and_repeated_calls_agree():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    sampler = RaceSampler(DEVICE)
    seeds, offsets = [11, 12, 13, 14, 15, 16], [0, 52, 104, 0, 52, 104]
    batch = sampler(logits, 1.0, seeds, offsets)
    assert torch.equal(sampler(logits, 1.0, seeds, offsets), batch)  # the per-row counts were reset
    for row in (0, 4):
        assert sampler(logits[row: row + 1], 1.0, [seeds[row]], [offsets[row]]).item() == batch[row].item()
    moved = sampler(logits, 1.0, seeds, [offset + 52 for offset in offsets])
    assert not torch.equal(moved, batch)  # fresh numbers past the offset (6 rows of 50 tokens: a clash is ~0)


def test_bad_arguments_raise_before_launching():
    sampler = RaceSampler(DEVICE)
    with pytest.raises(ValueError, match="float32 logits"):
        sampler(torch.zeros(2, 8, dtype=torch.float64, device=DEVICE), 1.0, [1, 2], [0, 0])
    with pytest.raises(ValueError, match="a seed and an offset per row"):
        sampler(torch.zeros(2, 8, device=DEVICE), 1.0, [1], [0, 0])
    with pytest.raises(ValueError, match="temperature > 0"):
        sampler(torch.zeros(2, 8, device=DEVICE), 0.0, [1, 2], [0, 0])


@pytest.mark.gpu
def test_a_large_sample_on_the_gpu_matches_the_softmax_closely():
    rows = 50_000
    generators = [torch.Generator(device="cuda").manual_seed(seed) for seed in range(rows)]
    logits = LOGITS.repeat(rows, 1).cuda()
    tokens = sampling_module.sample(logits, SamplingParams(temperature=0.7), generators)
    assert (frequencies(tokens, 5) - torch.softmax(LOGITS / 0.7, 0)).abs().max() < 0.01


@pytest.mark.gpu
def test_the_engine_races_on_the_gpu_per_branch_whatever_the_batch(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=256, block_size=8)
    params = SamplingParams(temperature=0.9, ignore_eos=True)
    trunk = eng.new_branch("trunk", "A tree of thought")
    kids = eng.fork(trunk, 4)
    together = eng.generate(kids, 10, params)
    assert any(device.type == "cuda" for device in sampling_module._race_samplers)  # the fused path ran
    vocab = eng.model.config.vocab_size
    assert all(kid.generator.get_offset() == 10 * (-(-vocab // 4) * 4) for kid in kids)
    eng.prune(kids)
    again = eng.fork(trunk, 4)  # the same names, so the same seeds
    one_at_a_time = eng.generate(again, 10, params, max_batch=1)
    assert one_at_a_time == together and len({tuple(t) for t in together}) == 4
