"""Engine.atomic(): several calls as one, all or nothing, whatever lands where (Ctrl-C included)."""
import pytest

from dendrite_nb import DendriteError, Engine, OutOfBlocks, SamplingParams
from tests.support.engines import engine_state


@pytest.fixture
def eng(checkpoint):
    engine = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4, debug=True)
    engine.new_branch("root", list(range(1, 23)))
    engine.fork("root", names=["kid"])
    engine.append("kid", [5, 6, 7])
    return engine


def test_calls_in_the_block_land_together(eng):
    with eng.atomic():
        eng.rewind("kid", 20)
        eng.append("kid", [9, 9])
        eng.fork("kid", names=["grandkid"])
    assert eng.branch("kid").tokens == list(range(1, 21)) + [9, 9]
    assert "grandkid" in eng.branches
    eng.audit()


@pytest.mark.parametrize("failure", ["error", "out of blocks", "ctrl-c in the forward"])
def test_a_failure_anywhere_in_the_block_undoes_all_of_it(eng, monkeypatch, failure):
    before = engine_state(eng)
    real_run = eng._runner.run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises((RuntimeError, OutOfBlocks, KeyboardInterrupt)):
        with eng.atomic():
            eng.rewind("kid", 10)
            eng.fork("kid", names=["other"])
            if failure == "error":
                raise RuntimeError("the caller's own failure")
            if failure == "out of blocks":
                eng.append("kid", list(range(1, 400)))
            monkeypatch.setattr(eng._runner, "run", interrupted)
            eng.append("kid", [3, 4, 5])
    monkeypatch.setattr(eng._runner, "run", real_run)
    assert engine_state(eng) == before
    eng.audit()


def test_generate_is_refused_inside_and_nothing_changes(eng):
    before = engine_state(eng)
    with pytest.raises(DendriteError, match="cannot run while atomic"):
        with eng.atomic():
            eng.append("kid", [1])
            eng.generate(["kid"], 2, SamplingParams(temperature=0.0))
    assert engine_state(eng) == before
