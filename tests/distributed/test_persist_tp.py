"""A session saved at one tensor-parallel degree restores at another (CPU, gloo): the whole model's fingerprint and
the KV of every rank's heads are saved as one process saves them, so the restored engine's logits and greedy tokens
go on exactly as the saved one's."""
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.testing import TINY_SHAPES
from tests.support.engines import engine_state

GREEDY = SamplingParams(temperature=0.0)
CONFIG = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]


def grown(engine: Engine) -> None:
    """A prompt, a fork mid-block, both decoded: shared and private blocks, copy-on-write."""
    engine.new_branch("trunk", PROMPT)
    engine.generate(["trunk"], 7, GREEDY)
    engine.fork("trunk", names=["kid"])
    engine.generate(["trunk", "kid"], 5, SamplingParams(temperature=0.8, top_k=40))


def test_a_session_moves_between_degrees(tmp_path):
    """Saved in one process, restored at TP=2 (the same tree, blocks and logits; saved again there, before its own
    steps), then that file restored in one process: both continue with the tokens the first engine decoded."""
    one = Engine.from_random(CONFIG, num_blocks=64, block_size=16)
    grown(one)
    one.save(tmp_path / "one.dendrite")
    state, logits = engine_state(one), one.next_logits(["trunk", "kid"])
    expected = one.generate(["trunk", "kid"], 12, GREEDY)
    one.close()
    two = Engine.restore(tmp_path / "one.dendrite", tensor_parallel=2)
    try:
        assert two.tensor_parallel == 2 and engine_state(two) == state
        torch.testing.assert_close(two.next_logits(["trunk", "kid"]), logits, rtol=0, atol=1e-4)
        two.save(tmp_path / "two.dendrite")
        assert two.generate(["trunk", "kid"], 12, GREEDY) == expected
    finally:
        two.close()
    back = Engine.restore(tmp_path / "two.dendrite")
    try:
        assert back.tensor_parallel == 1 and engine_state(back) == state
        assert back.generate(["trunk", "kid"], 12, GREEDY) == expected
    finally:
        back.close()


def test_check_restore_raises_what_restore_would_and_builds_nothing(tmp_path):
    """Engine.check_restore (what the notebook runs before closing a tensor-parallel engine for a restore): a
    damaged file, a degree the model cannot be split by, an unknown option and a bad device raise as restore does;
    a good request passes, and no check builds a model or starts a worker."""
    import multiprocessing

    import pytest

    from dendrite_nb.errors import SaveFileError

    one = Engine.from_random(CONFIG, num_blocks=64, block_size=16)
    grown(one)
    good = one.save(tmp_path / "good.dendrite")
    one.close()
    damaged = tmp_path / "damaged.dendrite"
    damaged.write_bytes(good.read_bytes()[:-100])
    children = multiprocessing.active_children()
    for path, overrides, error, message in (
            (damaged, {}, SaveFileError, "not a readable save file"),
            (good, {"tensor_parallel": 3}, SaveFileError, r"tensor_parallel=3 cannot split .* runs at tensor_parallel 1, 2"),
            (good, {"tensor_parallel": 0}, SaveFileError, "must be an int >= 1"),
            (good, {"seed": 3}, TypeError, "unexpected options"),
            (good, {"device": "bogus"}, ValueError, "bogus")):
        with pytest.raises(error, match=message):
            Engine.check_restore(path, **overrides)
        with pytest.raises(error, match=message):   # restore itself agrees
            Engine.restore(path, **overrides)
    Engine.check_restore(good, tensor_parallel=2)
    Engine.check_restore(good)
    assert multiprocessing.active_children() == children
