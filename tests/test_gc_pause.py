"""generate keeps the cyclic garbage collector off the objects older than the call, and only during it."""
import gc
import weakref

import pytest

from dendrite_nb import DecodeStep, SamplingParams
from dendrite_nb.gc_pause import older_objects_frozen

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class Cyclic:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_older_objects_are_frozen_during_generate_and_collected_after(engine):
    root = engine.new_branch("root", "The cat sat")
    kept = Cyclic()
    gone = weakref.ref(kept)
    counts = []

    def during(event):
        if isinstance(event, DecodeStep):
            counts.append(gc.get_freeze_count())
            if event.step == 0:
                nonlocal kept
                kept = None  # the cycle made before the call is garbage now; a collection cannot see it yet
                gc.collect()
                counts.append(gone() is not None)
    with engine.subscribe(during):
        engine.generate([root], 3, GREEDY)
    assert counts[0] > 0 and counts[1] is True and all(count > 0 for count in counts[2:])
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # back with the collector after the call


def test_an_error_inside_generate_unfreezes(engine):
    root = engine.new_branch("root", "The cat sat")

    def fail(event):
        if isinstance(event, DecodeStep):
            raise RuntimeError("a listener failed")
    with engine.subscribe(fail), pytest.raises(RuntimeError, match="a listener failed"):
        engine.generate([root], 3, GREEDY)
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_someone_else_and_nested_calls_are_left_as_they_are():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with older_objects_frozen():
            assert gc.get_freeze_count() == before
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
    with older_objects_frozen():
        frozen = gc.get_freeze_count()
        with older_objects_frozen():  # a listener's generate inside a generate
            pass
        assert gc.get_freeze_count() == frozen > 0
    assert gc.get_freeze_count() == 0
    gc.disable()
    try:
        with older_objects_frozen():  # a caller who turned the collector off wants no collection work at all
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
