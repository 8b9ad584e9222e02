"""Engine.write: one change of the tree as one call (what a %%branch cell does), all or nothing.

Whatever refuses it, and wherever an exception or Ctrl-C lands in it (the new branch or fork made, the tokens
half written), the tree, the refcounts and the free blocks are exactly as they were.
"""
import pytest

from dendrite_nb import ConstraintError, ContextOverflow, OutOfBlocks, SamplingParams
from tests.support.engines import engine_state, interrupt_forward_call

TEXT = "The cat sat on the mat and looked at the door"


@pytest.fixture
def tree(engine):
    root = engine.new_branch("root", "Once upon a time")
    engine.fork(root, names=["side"])
    engine.prefill_chunk_tokens = 4   # several forwards a write: an interrupt can land between them
    return engine


# (what the write makes of "x": a new branch, a fork of root, or root extended)
WRITES = {"new": dict(name="x"), "fork": dict(name="x", fork_of="root"), "extend": dict(name="root")}


@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_write_does_what_its_calls_do_in_turn(tree, checkpoint, kind):
    from dendrite_nb import Engine

    branch = tree.write(content=TEXT, **WRITES[kind])
    reference = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    ref_root = reference.new_branch("root", "Once upon a time")
    if kind == "new":
        expected = reference.new_branch("x", TEXT)
    else:
        expected = reference.fork(ref_root, names=["x"])[0] if kind == "fork" else ref_root
        reference.append(expected, TEXT)
    assert branch.tokens == expected.tokens
    tree.audit()


@pytest.mark.parametrize("kind", sorted(WRITES))
@pytest.mark.parametrize("refusal, error", [
    (dict(room_for=10**9), ContextOverflow),                   # checked after the branch is made
    (dict(room_for=4, constraint={"regex": "("}), ConstraintError),   # checked after the text is written
])
def test_a_refused_write_changes_nothing(tree, kind, refusal, error):
    before = engine_state(tree)
    with pytest.raises(error):
        tree.write(content=TEXT, **WRITES[kind], **refusal, sampling=SamplingParams(temperature=0.0))
    assert engine_state(tree) == before
    tree.audit()


@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_write_that_finds_no_room_changes_nothing(engine, kind):
    engine.new_branch("root", "Once upon a time")
    hog = engine.new_branch("hog", [1] * (4 * (engine.num_free_blocks - 2)))
    before = engine_state(engine)
    with pytest.raises(OutOfBlocks):
        engine.write(content=TEXT, **WRITES[kind])
    assert engine_state(engine) == before and len(hog) > 0
    engine.audit()


@pytest.mark.parametrize("kind", sorted(WRITES))
@pytest.mark.parametrize("call", [1, 2, 3])
def test_ctrl_c_anywhere_in_a_write_changes_nothing(tree, monkeypatch, kind, call):
    """Ctrl-C (or any exception) in the write's first, second or third forward: the whole write is undone."""
    before = engine_state(tree)
    interrupt_forward_call(monkeypatch, tree, call)
    with pytest.raises(KeyboardInterrupt):
        tree.write(content=TEXT, **WRITES[kind])
    assert engine_state(tree) == before
    monkeypatch.undo()
    tree.audit()
    tree.write(content=TEXT, **WRITES[kind])   # and the same write then goes through
    tree.audit()
