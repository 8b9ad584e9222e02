"""Priorities: generate(max_batch=N) decodes the highest-priority running branches each step, re-reading the
priorities every step (a value function may re-rank them), and no branch's tokens depend on the schedule."""
import pytest

from dendrite_nb import DecodeStep, Engine, SamplingParams

from tests.support.engines import engine_state

SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)


def two_families(eng: Engine) -> list[str]:
    """Six branches: three under one fork point, three under another."""
    trunk = eng.new_branch("trunk", "A tree of thought, with branches that share")
    left, right = eng.fork(trunk, names=["left", "right"])
    eng.append(left, " the left way")
    eng.append(right, " the right way")
    return [b.name for b in eng.fork(left, 3) + eng.fork(right, 3)]


@pytest.fixture
def pair(checkpoint):
    return [Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4) for _ in range(2)]


def finishing_steps(eng: Engine, names, **options) -> tuple[list[list[int]], dict[str, int], list[tuple[str, ...]]]:
    finished, batches = {}, []

    counts = dict.fromkeys(names, 0)

    def record(event):  # a branch is done at the step that gives it its 6th token
        if isinstance(event, DecodeStep):
            batches.append(event.branches)
            for name in event.branches:
                counts[name] += 1
                if counts[name] == 6:
                    finished[name] = event.step

    with eng.subscribe(record):
        outputs = eng.generate(names, 6, SAMPLED, **options)
    return outputs, finished, batches


def test_a_small_batch_runs_high_priority_first_and_changes_no_tokens(pair):
    free, scheduled = pair
    names = two_families(free)
    assert two_families(scheduled) == names
    priorities = dict(zip(names, [3.0, 0.0, 5.0, 1.0, 4.0, 2.0]))  # not the tree's order
    for name, priority in priorities.items():
        scheduled.set_priority(name, priority)
    expected = free.generate(names, 6, SAMPLED)
    outputs, finished, batches = finishing_steps(scheduled, names, max_batch=2)
    assert outputs == expected
    assert all(len(batch) <= 2 for batch in batches) and len(batches) == 6 * 3
    by_priority = sorted(names, key=priorities.get, reverse=True)
    assert [finished[name] for name in by_priority] == sorted(finished.values())
    scheduled.audit()


def test_a_value_function_can_re_rank_branches_between_steps(pair):
    free, scheduled = pair
    names = two_families(free)
    two_families(scheduled)
    expected = free.generate(names, 6, SAMPLED)

    def round_robin(event):  # what ran loses rank: every branch gets a turn
        if isinstance(event, DecodeStep):
            for name in event.branches:
                scheduled.branch(name).priority -= 1.0

    with scheduled.subscribe(round_robin):
        outputs, finished, batches = finishing_steps(scheduled, names, max_batch=3)
    assert outputs == expected
    assert set(batches[0]) | set(batches[1]) == set(names)  # the second step ran the other three
    assert max(finished.values()) - min(finished.values()) <= 1


def test_ties_batch_siblings_together(pair):
    _, eng = pair
    names = two_families(eng)
    _, _, batches = finishing_steps(eng, names, max_batch=3)
    assert set(batches[0]) in ({"left/0", "left/1", "left/2"}, {"right/0", "right/1", "right/2"})


def test_bad_batches_and_priorities_are_refused_and_change_nothing(pair):
    _, eng = pair
    names = two_families(eng)
    before = engine_state(eng)
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match="max_batch must be a positive int"):
            eng.generate(names, 2, max_batch=bad)
    for bad in (float("nan"), float("inf"), "high", True):
        with pytest.raises(ValueError, match="a priority is a finite number"):
            eng.set_priority(names[0], bad)
    assert engine_state(eng) == before and eng.branch(names[0]).priority == 0.0


def test_forks_inherit_their_parent_priority(pair):
    _, eng = pair
    trunk = eng.new_branch("trunk", "Rank me")
    eng.set_priority(trunk, 2.5)
    assert [kid.priority for kid in eng.fork(trunk, 2)] == [2.5, 2.5]
