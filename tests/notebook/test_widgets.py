"""The live views' synced state: what the front end is sent must equal the engine's snapshots, every
update must be one message with arrays as binary buffers, and the throttle must bound the messages."""
import re
import threading
import warnings
from pathlib import Path

import comm
import numpy as np
import pytest
from comm.base_comm import BaseComm
from traitlets import Bytes

from dendrite_nb import DecodeStep, Engine, SamplingParams
from dendrite_nb.guidance import Guidance
from dendrite_nb.widgets import BlockTableView, ThroughputView, TreeView, node_label
from dendrite_nb.widgets.feed import ThrottledFeed

from tests.support.engines import engine_state

STATIC = Path(__file__).resolve().parents[2] / "widgets" / "static"
SAMPLE = SamplingParams(temperature=1.0, seed=3, ignore_eos=True)


class RecordingComm(BaseComm):
    """A comm that keeps what it would have sent to the front end."""

    def __init__(self, *args, **kwargs):
        self.sent = []
        super().__init__(*args, **kwargs)

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        self.sent.append((msg_type, data, buffers or []))


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda *args, **kwargs: RecordingComm(*args, **kwargs))


def updates(view):
    return [(data, buffers) for kind, data, buffers in view.comm.sent
            if kind == "comm_msg" and data.get("method") == "update"]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def eng(checkpoint):
    engine = Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4, debug=True)
    engine.new_branch("root", "a shared prompt of several tokens")
    return engine


def int32s(data: bytes) -> list[int]:
    return np.frombuffer(data, np.int32).tolist()


def test_tree_view_nodes_labels_and_blocks_equal_the_snapshot(eng):
    eng.fork("root", 3)
    eng.generate(["root/0", "root/1"], 5, SAMPLE)
    view = TreeView(eng, interval_s=0)
    snapshot = eng.tree()
    assert [(n["id"], n["parent"], n["num_tokens"]) for n in view._nodes] == \
           [(n["id"], n["parent"], n["num_tokens"]) for n in snapshot["nodes"]]
    assert [n["label"] for n in view._nodes] == [node_label(n) for n in snapshot["nodes"]]
    assert {n["label"] for n in view._nodes} >= {"root/0", "root/1", "root, root/2"}
    offsets, blocks = int32s(view._block_offsets), int32s(view._blocks)
    assert [blocks[a:b] for a, b in zip(offsets, offsets[1:])] == [n["blocks"] for n in snapshot["nodes"]]
    assert np.frombuffer(view._refcounts, np.uint16).tolist() == [eng.pool.allocator.refcount(b) for b in blocks]
    assert view._nodes[-1]["tail"] == eng.decode(snapshot["nodes"][-1]["tokens"][-24:], skip_end_tokens=True)


def test_tree_view_colours_decoding_then_finished_then_idle(eng):
    eng.fork("root", 2)
    view = TreeView(eng, interval_s=0)
    seen = []
    eng.subscribe(lambda event: seen.append({n["label"]: n["state"] for n in view._nodes}))
    eng.generate(["root/0", "root/1"], 3, SAMPLE)
    assert seen[0]["root/0"] == seen[0]["root/1"] == "decoding"
    assert {n["label"]: n["state"] for n in view._nodes}["root/0"] == "idle"
    eng.eos_token_ids = frozenset(range(eng.config.vocab_size))   # every token ends the branch
    eng.generate(["root/0"], 3, SamplingParams(temperature=1.0, seed=1))
    states = {n["label"]: n["state"] for n in view._nodes}
    assert states["root/0"] == "finished" and states["root/1"] == "idle"
    assert next(n for n in view._nodes if n["parent"] is None)["state"] == "shared"


def test_tree_view_shows_a_preempted_branch_until_it_grows_again(eng):
    eng.fork("root", 2)
    eng.generate(["root/0", "root/1"], 2, SAMPLE)   # each gets a leaf node of its own
    view = TreeView(eng, interval_s=0)
    eng.preempt("root/1")
    states = {n["label"]: n["state"] for n in view._nodes}
    assert states["root/1"] == "preempted" and states["root/0"] == "idle"
    eng.generate(["root/1"], 2, SAMPLE)
    assert {n["label"]: n["state"] for n in view._nodes}["root/1"] == "idle"


def test_selection_is_validated_and_dropped_when_its_branch_is_pruned(eng):
    eng.fork("root", 2)
    view = TreeView(eng, interval_s=0)
    view.set_state({"selected": "root/1"})   # what a click in the browser sends
    assert view.selected == "root/1"
    before = engine_state(eng)
    with pytest.raises(Exception, match="there is no branch 'nope' to select; the branches are: root, root/0"):
        view.selected = "nope"
    assert view.selected == "root/1" and engine_state(eng) == before
    eng.prune("root/1")
    assert view.selected is None


def test_block_table_view_arrays_equal_the_snapshot_with_copies_and_outline(eng):
    # the prompt ends mid-block, so each child's first write copies the shared partial block
    assert len(eng.branch("root")) % 4 != 0
    eng.fork("root", 3)
    eng.generate(["root/0", "root/1", "root/2"], 6, SAMPLE)
    view = BlockTableView(eng, interval_s=0)
    snapshot = eng.block_table()
    readers = np.frombuffer(view._readers, np.uint16)
    nodes = np.frombuffer(view._nodes, np.int32)
    copies = np.frombuffer(view._copy_on_write, np.uint8)
    assert view._num_blocks == eng.pool.num_blocks == len(readers)
    used = {b["id"]: b for b in snapshot["blocks"]}
    for block_id in range(view._num_blocks):
        if block_id in used:
            assert readers[block_id] == used[block_id]["readers"] and nodes[block_id] == used[block_id]["node"]
            assert copies[block_id] == used[block_id]["copy_on_write"]
        else:
            assert readers[block_id] == 0 and nodes[block_id] == -1
    assert copies.sum() == 3   # one private copy of the partial block per child
    view.selected = "root/2"
    assert int32s(view._selected_blocks) == snapshot["branches"]["root/2"]


def test_a_copy_on_write_copy_is_the_first_block_of_a_node_that_starts_mid_block(eng):
    eng.fork("root", 2)
    eng.generate(["root/0", "root/1"], 2, SAMPLE)
    tree = eng.tree()
    starts = {n["id"]: n["start"] for n in tree["nodes"]}
    for block in eng.block_table()["blocks"]:
        first_of_node = block["logical_index"] == starts[block["node"]] // 4
        assert block["copy_on_write"] == (first_of_node and starts[block["node"]] % 4 != 0)


def test_throughput_view_shows_the_latest_generation_per_step(eng):
    eng.fork("root", 4)
    view = ThroughputView(eng, interval_s=0)
    eng.generate([f"root/{i}" for i in range(4)], 5, SAMPLE)
    assert np.frombuffer(view._batch_sizes, np.uint32).tolist() == [4] * 5
    step_s = np.frombuffer(view._step_s, np.float64)
    assert len(step_s) == 5 and (step_s > 0).all() and view._call == 1
    eng.generate(["root/0"], 2, SAMPLE)
    assert np.frombuffer(view._batch_sizes, np.uint32).tolist() == [1, 1] and view._call == 2
    assert re.match(r"last generation: 2 steps, 2 tokens in [\d.]+ s", repr(view))


def test_every_throughput_view_shares_one_copy_of_plotly_js(eng):
    first, second = ThroughputView(eng), ThroughputView(eng)
    assert first._plotly is second._plotly
    assert first._plotly._source.lstrip().startswith("/**\n* plotly.js")


def test_updates_are_single_messages_with_arrays_as_binary_buffers(eng, recorded):
    eng.fork("root", 2)
    blocks, tree = BlockTableView(eng, interval_s=0), TreeView(eng, interval_s=0)
    eng.generate(["root/0", "root/1"], 6, SAMPLE)
    for view in (blocks, tree):
        sent = updates(view)
        assert 0 < len(sent) <= 7   # at most one per step, plus the end of the generation
        array_traits = {name for name, trait in view.traits(sync=True).items() if isinstance(trait, Bytes)}
        assert any(data["buffer_paths"] for data, _ in sent)
        for data, buffers in sent:
            assert len(buffers) == len(data["buffer_paths"])
            assert {path[0] for path in data["buffer_paths"]} <= array_traits
            assert not array_traits & data["state"].keys()   # never inline (as base64 or lists)


def test_a_long_generation_sends_a_bounded_number_of_messages(eng, recorded):
    """200 steps of 10 ms each on a fake clock: at most one update per 100 ms, plus the final state."""
    names = [b.name for b in eng.fork("root", 4)]
    clock = FakeClock()
    views = [TreeView(eng, clock=clock), BlockTableView(eng, clock=clock), ThroughputView(eng, clock=clock)]
    eng.subscribe(lambda event: setattr(clock, "now", clock.now + 0.01))   # each event: 10 ms later
    steps = 60
    eng.generate(names, steps, SAMPLE)
    allowed = steps * 0.01 / 0.1 + 2   # the leading update, one per interval, the forced final one
    for view in views:
        assert 3 <= len(updates(view)) <= allowed, type(view).__name__
    assert np.frombuffer(views[2]._batch_sizes, np.uint32).tolist() == [4] * steps   # nothing lost
    assert [n["num_tokens"] for n in views[0]._nodes] == [n["num_tokens"] for n in eng.tree()["nodes"]]


def test_a_burst_of_changes_in_one_cell_is_sent_when_the_cell_ends(eng):
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or get_ipython()   # the global test shell, made once per process
    shell.user_ns["eng"] = eng
    shell.user_ns["view"] = view = TreeView(eng, clock=FakeClock())   # time stands still: all held back
    shell.run_cell("for i in range(5):\n    eng.fork('root', names=[f'x{i}'])")
    assert view._feed.pending is False
    assert {f"x{i}" for i in range(5)} <= {name for n in view._nodes for name in n["branches"]}
    view.close()


def test_a_failing_view_warns_and_never_stops_a_generation(eng):
    view = TreeView(eng, interval_s=0)
    view._state = lambda: 1 / 0
    with pytest.warns(UserWarning, match="a dendrite view failed to update"):
        out = eng.generate(["root"], 3, SAMPLE)
    assert len(out[0]) == 3 and view._feed.error.startswith("ZeroDivisionError")
    assert view._error.startswith("ZeroDivisionError")   # the view itself says it is stale


def test_closing_a_view_stops_its_updates(eng):
    listeners = len(eng._listeners)
    view = TreeView(eng)
    assert len(eng._listeners) == listeners + 1
    view.close()
    assert len(eng._listeners) == listeners
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.generate(["root"], 2, SAMPLE)


def test_bad_arguments_are_refused_clearly(eng):
    with pytest.raises(TypeError, match="a view needs a dendrite_nb.Engine, got str"):
        TreeView("engine")
    with pytest.raises(ValueError, match="interval_s must be >= 0 seconds"):
        ThrottledFeed(eng, lambda: None, interval_s=-1)
    listeners = len(eng._listeners)
    eng.close()
    with pytest.raises(ValueError, match="this engine was closed"):
        BlockTableView(eng)
    assert len(eng._listeners) == listeners


def test_a_large_pool_is_sent_as_compact_arrays(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=100_000, block_size=4)
    eng.new_branch("root", "hello")
    view = BlockTableView(eng)
    assert view._num_blocks == 100_000
    assert len(view._readers) == 2 * 100_000 and len(view._nodes) == 4 * 100_000
    assert np.count_nonzero(np.frombuffer(view._readers, np.uint16)) == len(eng.block_table()["blocks"])


def test_front_end_files_import_nothing_from_the_network_and_stay_small():
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"""(import|from)\s*\(?\s*["']https?:""", text), path.name
        assert "url(http" not in text, path.name
        assert path.stat().st_size < 50_000, path.name


def test_a_slow_view_widens_its_gap_to_keep_its_share_of_the_engine_small(eng):
    """An update costing 20 ms may come at most every 400 ms (5% of the time), not every 100 ms."""
    clock = FakeClock()

    def slow_update():
        clock.now += 0.02

    feed = ThrottledFeed(eng, slow_update, clock=clock)
    for step in range(100):   # 100 steps of 10 ms each: 1 s of decoding
        clock.now += 0.01
        feed._on_event(DecodeStep(step, 100, ("root",), (1,), (), 0.01))
    assert feed.gap_s == pytest.approx(0.02 / 0.05)
    assert 2 <= feed.flushes <= 1.0 / 0.4 + 2   # instead of the ~10 a cheap view would send
    feed.close()


def test_the_tree_view_names_each_branch_constraint_and_whether_it_is_complete(eng):
    eng.fork("root", names=["json", "free"])
    eng.constrain("json", {"choices": ["yes", "no"]})
    view = TreeView(eng, interval_s=0)
    node = next(n for n in view._nodes if "json" in n["branches"])
    assert node["constraints"] == ["json: choices (2 options)"]
    eng.generate(["json", "free"], 8, SAMPLE)   # the views follow: json completes its choice
    json_node = next(n for n in view._nodes if n["branches"] == ["json"])
    assert json_node["constraints"] == ["json: choices (2 options) (complete)"]
    assert next(n for n in view._nodes if n["branches"] == ["free"])["constraints"] == []


@pytest.fixture
def slow_mask_fills(monkeypatch):
    """Every constraint mask fill holds its matchers from its start until the engine waits for its result,
    as a long fill does: llguidance borrows them (mutably, in Rust) for the whole fill, and a matcher read
    meanwhile raises RuntimeError('Already mutably borrowed')."""
    import llguidance.torch as lltorch

    holding, release = threading.Event(), threading.Event()
    release.set()

    class HeldRow:   # llguidance reads a row's index after it has borrowed the matchers
        def __init__(self, row):
            self.row = row

        def __index__(self):
            holding.set()
            release.wait(timeout=30)
            return self.row

    class Waited:   # the engine's wait for the mask ends the hold
        def __init__(self, future):
            self.future = future

        def result(self):
            release.set()
            return self.future.result()

    real_fill, real_start = lltorch.fill_next_token_bitmask_par, Guidance.start_fill

    def fill(executor, pairs, bitmask):
        *rest, (matcher, row) = pairs
        real_fill(executor, [*rest, (matcher, HeldRow(row))], bitmask)

    def start_fill(self, matchers):
        holding.clear()
        release.clear()
        future = real_start(self, matchers)
        assert holding.wait(timeout=30), "the mask fill never started"
        with pytest.raises(RuntimeError, match="Already mutably borrowed"):   # the hold is real
            matchers[-1].is_stopped()
        return Waited(future)

    monkeypatch.setattr(lltorch, "fill_next_token_bitmask_par", fill)
    monkeypatch.setattr(Guidance, "start_fill", start_fill)


def test_the_tree_view_updates_at_every_step_however_long_the_masks_take_to_fill(eng, slow_mask_fills):
    """A view updated from a step's event while the next step's masks filled once failed with
    'Already mutably borrowed' (seen in CI): the engine must run its listeners while no fill holds a matcher."""
    eng.fork("root", names=["word", "free"])
    eng.constrain("word", {"regex": "[a-z]{40}"})   # still decoding, so masked, at every step of the call
    # Each update reads every matcher (is its grammar complete?); on a still clock each event updates it.
    view = TreeView(eng, interval_s=0, clock=FakeClock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.generate(["word", "free"], 6, SAMPLE)
    assert view._feed.error is None and view._feed.flushes == 7   # each step and the end of the call
    assert re.fullmatch("[a-z]{6,40}", eng.decode(eng.branch("word").tokens[-6:]))   # the masks applied
    assert next(n for n in view._nodes if n["branches"] == ["word"])["constraints"] == ["word: regex ([a-z]{40})"]
