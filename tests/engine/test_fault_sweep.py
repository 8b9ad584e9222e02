"""A fault at any line of any engine operation leaves no damage (the bounded, seeded form of the sweep).

`python -m dendrite_nb.testing.sweep` injects at every executed line instead (dendrite_nb/testing/sweep.py
says what is checked after each fault)."""
import pytest
import torch

from dendrite_nb.testing.faults import LineFault, count_lines
from dendrite_nb.testing.sweep import OPERATIONS, Sweep

LINES_PER_OPERATION = 10   # x 2 exceptions x 13 operations: about 30 s on 2 idle cores


@pytest.fixture(scope="module")
def sweep():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a tiny model: more threads only contend
    yield Sweep()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.name for op in OPERATIONS])
def test_a_fault_at_any_line_leaves_no_damage(sweep, operation):
    import random

    expected = sweep.baseline(operation)
    engine = sweep.fresh(operation)
    total = count_lines(lambda: operation.run(engine))
    rng = random.Random(f"{operation.name}-0")   # seeded per operation: each test stands alone
    lines = sorted(rng.sample(range(1, total + 1), min(total, LINES_PER_OPERATION)))
    for exception in (KeyboardInterrupt, RuntimeError):
        for line in lines:
            assert sweep.inject(operation, line, exception, expected), f"line {line} of {total} never ran"


def test_the_fault_fires_where_it_is_told_and_once():
    calls = []

    def traced():   # lines of this test module are not dendrite-nb code: count what an engine call runs
        from dendrite_nb.kv.allocator import BlockAllocator

        allocator = BlockAllocator(4)
        calls.append(allocator.allocate(2))

    total = count_lines(traced)
    assert total > 3
    with pytest.raises(KeyboardInterrupt, match=f"injected fault at traced line {total}"):
        with LineFault(total, KeyboardInterrupt) as fault:
            traced()
    assert fault.fired and fault.count == total
    with LineFault(total + 1, KeyboardInterrupt) as fault:
        traced()
    assert not fault.fired
