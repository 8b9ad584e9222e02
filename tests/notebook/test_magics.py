"""The magics, driven through a real IPython InteractiveShell (run_line_magic / run_cell_magic)."""
import gc
import json
import weakref

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from dendrite_nb import DecodeStep, Engine, GenerationInterrupted, SamplingParams
from dendrite_nb.magics import current_engine, current_session

from tests.support.engines import engine_state
from tests.support.notebook_session import PROMPT, magic


def test_every_magic_documents_usage_options_and_examples(shell):
    """`%magic?` shows these docstrings; magic_arguments writes the usage line ("::  %fork [...]") and options."""
    for name in ("fork", "gen", "prune", "show"):
        doc = shell.find_line_magic(name).__doc__
        assert doc.startswith(f"::\n\n  %{name} ") and "arguments:" in doc and "Examples" in doc, name
    for name in ("tree", "blocks", "throughput"):
        doc = shell.find_line_magic(name).__doc__
        assert f"Usage: ``%{name}``" in doc and "Examples" in doc, name
    doc = shell.find_line_magic("dendrite").__doc__
    assert "Usage::" in doc and "Options:" in doc and "Examples::" in doc
    doc = shell.find_cell_magic("branch").__doc__
    assert doc.startswith("::\n\n  %branch ") and "--from" in doc and "--temperature" in doc and "Examples" in doc


def test_magics_before_a_model_is_loaded_say_how_to_load_one(shell):
    session = current_session()
    if session.engine is not None:
        session.close_views()
        session.engine.close()
    session.engine = None
    for line in ("gen root", "fork root --n 2", "prune root", "show root", "tree", "blocks", "throughput",
                 "dendrite status"):
        with pytest.raises(UsageError, match="%dendrite demo"):
            magic(shell, line)
    with pytest.raises(UsageError, match="%dendrite demo"):
        magic(shell, "branch root", "hello")


def test_branch_fork_gen_prune_match_the_python_api(ip, checkpoint):
    magic(ip, "fork root plan/0 plan/1 plan/2")
    result, shown = magic(ip, "gen plan/* --max-tokens 6 --temperature 0.9 --top-p 0.95 --ignore-eos")
    magic(ip, "branch careful --from plan/1 --gen 4 -t 0", " so the safest way is")

    reference = Engine.from_pretrained(checkpoint(), num_blocks=48, block_size=4)
    root = reference.new_branch("root", PROMPT)
    kids = reference.fork(root, names=["plan/0", "plan/1", "plan/2"])
    expected = reference.generate(kids, 6, SamplingParams(temperature=0.9, top_p=0.95, ignore_eos=True))
    assert list(result.names) == ["plan/0", "plan/1", "plan/2"]
    assert [list(t) for t in result.tokens] == expected
    assert result["plan/1"] == reference.decode(expected[1], skip_end_tokens=True)   # shown without end tokens
    careful = reference.fork("plan/1", names=["careful"])[0]
    reference.append(careful, " so the safest way is")
    reference.generate([careful], 4, SamplingParams(temperature=0.0))
    assert current_engine().branch("careful").tokens == careful.tokens

    pruned, _ = magic(ip, "prune plan/0 plan/2")
    assert list(pruned) == ["plan/0", "plan/2"] and pruned.freed_blocks > 0
    current_engine().audit()
    assert sorted(current_engine().branches) == ["careful", "plan/1", "root"]


def test_gen_logprobs_show_each_branchs_mean_and_match_the_engine(ip):
    magic(ip, "fork root a b")
    result, _ = magic(ip, "gen a b -n 5 --ignore-eos --logprobs -t 0.7")
    engine = current_engine()
    means = result.mean_logprobs()
    for name in ("a", "b"):
        kept = engine.logprobs(name)[-5:]
        assert None not in kept and means[name] == pytest.approx(sum(kept) / 5)
    assert "mean logprob" in repr(result) and f"{means['a']:.3f}" in repr(result)
    assert "mean log-prob" in result._repr_html_()
    plain, _ = magic(ip, "gen a -n 2 --ignore-eos")
    with pytest.raises(ValueError, match="run %gen with --logprobs"):
        plain.mean_logprobs()
    assert "mean logprob" not in repr(plain)


def test_branch_logprobs_score_the_cells_text_and_its_generation(ip):
    result, _ = magic(ip, "branch answer --from root --logprobs", " Swim across the river.")
    engine = current_engine()
    added = len(engine.branch("answer")) - len(engine.branch("root"))
    kept = engine.logprobs("answer")[-added:]
    assert None not in kept and result.text_logprob == pytest.approx(sum(kept) / added)
    assert f"the text's mean logprob {result.text_logprob:.3f}" in repr(result)
    generated, _ = magic(ip, "branch answer --gen 3 --ignore-eos --logprobs", " So")
    assert None not in engine.logprobs("answer")[-4:] and len(generated.mean_logprobs()) == 1
    plain, _ = magic(ip, "branch other --from root", " Walk.")
    assert plain.text_logprob is None and "logprob" not in repr(plain)


def test_gen_streams_one_line_per_branch_and_ends_with_a_summary(ip):
    magic(ip, "fork root a b")
    result, shown = magic(ip, "gen a b -n 5 --ignore-eos")
    texts = [output.data["text/plain"] for output in shown.outputs]
    assert "a │" in texts[0] and "b │" in texts[0] and "0/5 steps" in texts[0]
    assert texts[-1].startswith("[" + "#" * 30 + "] ✓ 2 branches, 10 tokens, 5 steps")
    assert "<table" in result._repr_html_()
    assert repr(result).startswith("2 branches, 10 new tokens, 5 steps")


def test_live_updates_are_throttled(ip, monkeypatch):
    from dendrite_nb.magics import live

    clock = {"now": 0.0}
    monkeypatch.setattr(live.time, "perf_counter", lambda: clock["now"])
    real_generate = Engine.generate

    def generate_with_fake_time(self, *args, **kwargs):
        def tick(event):
            if isinstance(event, DecodeStep):
                clock["now"] += 0.01  # 10 ms per step: 40 steps take 0.4 s
        with self.subscribe(tick):
            return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", generate_with_fake_time)
    _, shown = magic(ip, "gen root -n 40 --ignore-eos")
    # the first display, then at most one redraw per 0.1 s of the 0.4 s, then the final one
    assert 2 <= len(shown.outputs) <= 1 + 5 + 1


def test_show_marks_the_fork_points(ip):
    magic(ip, "fork root a b")
    magic(ip, "branch a", " one way")
    magic(ip, "branch b", " another way")
    magic(ip, "branch a2 --from a", " and more")
    shown, _ = magic(ip, "show a2")
    assert shown.text == current_engine().text("a2")
    assert repr(shown).count("⑂") == 2
    assert [s.text for s in shown.segments][1:] == [" one way", " and more"]
    assert "b" in shown.segments[0].forks_after
    assert "⑂" in shown._repr_html_()


def test_views_are_live_widgets_of_the_session_engine(ip):
    import numpy as np
    from dendrite_nb.widgets import BlockTableView, ThroughputView, TreeView

    magic(ip, "fork root --n 2")
    magic(ip, "gen root/* -n 3")
    tree, _ = magic(ip, "tree")
    blocks, _ = magic(ip, "blocks")
    throughput, _ = magic(ip, "throughput")
    assert isinstance(tree, TreeView) and isinstance(blocks, BlockTableView) and isinstance(throughput, ThroughputView)
    assert len(tree._nodes) == len(current_engine().tree()["nodes"]) and "[root/0]" in repr(tree)
    assert np.frombuffer(throughput._batch_sizes, np.uint32).tolist() == [2, 2, 2]  # the steps before the view
    assert magic(ip, "tree")[0] is tree   # one model per engine: a second %tree is another view of it
    magic(ip, "gen root/0 -n 2")          # a later cell updates the views already shown
    assert np.frombuffer(throughput._batch_sizes, np.uint32).tolist() == [1, 1]
    fresh = TreeView(current_engine())
    assert tree._nodes == fresh._nodes
    fresh.close()
    readers = np.frombuffer(blocks._readers, np.uint16)
    assert (readers > 0).sum() == len(current_engine().block_table()["blocks"])
    tree.selected = "root/1"              # the tree's selection outlines the branch in the block table
    assert blocks.selected == "root/1"
    assert np.frombuffer(blocks._selected_blocks, np.int32).tolist() == current_engine().block_table()["branches"]["root/1"]
    status, _ = magic(ip, "dendrite status")
    assert "root/1" in repr(status)


def test_loading_another_model_closes_the_views_of_the_old_one(ip, checkpoint):
    tree, _ = magic(ip, "tree")
    magic(ip, f"dendrite load {checkpoint()} --replace --num-blocks 16")
    assert tree.comm is None and tree._feed.pending is False
    assert magic(ip, "tree")[0] is not tree


def test_load_picks_the_attention_backend_and_refuses_an_unknown_one_without_a_change(ip, checkpoint):
    before = current_engine()
    with pytest.raises(UsageError, match="attention backend 'fastest' is not available; choose one of"):
        magic(ip, f"dendrite load {checkpoint()} --attention fastest --replace --num-blocks 16")
    assert current_engine() is before and not before.closed
    magic(ip, f"dendrite load {checkpoint()} --attention torch --replace --num-blocks 16")
    assert current_engine().backend.name == "torch"


def test_an_interrupt_keeps_completed_steps_and_the_next_cell_works(ip):
    magic(ip, "fork root a b")

    def interrupt_at_step_3(event):
        if isinstance(event, DecodeStep) and event.step == 2:
            raise KeyboardInterrupt

    engine = current_engine()
    with engine.subscribe(interrupt_at_step_3), pytest.raises(GenerationInterrupted):
        magic(ip, "gen a b -n 10 --ignore-eos")
    partial = current_session().last_result
    assert partial.interrupted and partial.steps == 3 and [len(t) for t in partial.tokens] == [3, 3]
    assert len(engine.branch("a")) == len(engine.branch("root")) + 3
    engine.audit()
    result, _ = magic(ip, "gen a b -n 2 --ignore-eos")
    assert [len(t) for t in result.tokens] == [2, 2]
    engine.audit()


def test_replace_frees_the_first_engine_even_while_a_variable_holds_it(ip, checkpoint):
    old = current_engine()
    kv = weakref.ref(old.pool.kv)
    with pytest.raises(UsageError, match="--replace"):
        magic(ip, f"dendrite load {checkpoint()}")
    assert current_engine() is old and not old.closed
    loaded, _ = magic(ip, f"dendrite load {checkpoint()} --num-blocks 32 --block-size 4 --replace")
    gc.collect()
    assert kv() is None and old.closed and "closed" in repr(loaded)
    assert current_engine() is not old and current_engine().branches == {}


def test_demo_loads_the_embedded_model(shell, real_gguf):
    session = current_session()
    loaded, _ = magic(shell, "dendrite demo --replace --num-blocks 64")
    assert "demo" in repr(loaded) and current_engine().pool.num_blocks == 64
    magic(shell, "branch root", "Hello there")
    assert current_engine().text("root").endswith("Hello there")
    assert session.engine is current_engine()


class FakeKernel:
    """What ipykernel offers the magics: the execute_request being handled, with the cell's metadata."""

    def __init__(self, metadata):
        self.metadata = metadata

    def get_parent(self, channel="shell"):
        return {"metadata": self.metadata, "content": {}}


@pytest.fixture
def cell_metadata(ip, monkeypatch):
    def set_metadata(metadata):
        monkeypatch.setattr(ip, "kernel", FakeKernel(metadata), raising=False)
    return set_metadata


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("line, cell, message", [
    ("gen nope", None, "there is no branch 'nope'"),
    ("gen nope/*", None, "no branch matches 'nope/\\*'"),
    ("gen root -n 0", None, "--max-tokens takes a count >= 1"),
    ("gen root --temperature -1", None, "temperature must be >= 0"),
    ("gen root --top-p 2", None, "top_p must be in"),
    ("gen root --min-p 2", None, "min_p must be in"),
    ("gen root -n 5000", None, "the model allows"),
    ("gen root -n 1000", None, "OutOfBlocks"),
    ("gen root --frob", None, "unrecognized arguments"),
    ("fork root root", None, "already exists"),
    ("fork root a a", None, "appears twice"),
    ("fork root --n 0", None, "--n takes a count >= 1"),
    ("fork root a --n 2", None, "not both"),
    ("fork root", None, r"\(%fork PARENT --n K\)\.$"),
    ("fork nope a", None, "no branch named 'nope'"),
    ("fork root bad*name", None, "cannot name a branch"),
    ("prune root nope", None, "there is no branch 'nope'"),
    ("prune zz*", None, "no branch matches"),
    ("show nope", None, "no branch named 'nope'"),
    ("tree extra", None, "takes no arguments"),
    ("dendrite frob", None, "unknown subcommand 'frob'"),
    ("dendrite", None, "use %dendrite load"),
    ("dendrite load /no/such/folder --replace", None, "does not exist|no config"),
    ("branch root --from root", "x", "already exists"),
    ("branch new --from nope", "x", "no branch named 'nope'"),
    ("branch new --gen 3", "", "cell body is empty"),
    ("branch new --gen -1", "x", "--gen takes"),
    ("branch new --from root --gen 1000", "more", "OutOfBlocks"),
    ("branch root --gen 1000", "more", "OutOfBlocks"),
])
def test_bad_input_is_a_usage_error_that_changes_nothing(ip, line, cell, message):
    engine = current_engine()
    before = engine_state(engine)
    with pytest.raises(UsageError, match=message):
        magic(ip, line, cell)
    assert engine_state(engine) == before
    assert current_engine() is engine
    engine.audit()


@pytest.mark.parametrize("metadata, inline, message", [
    ({"dendrite": {"json_schema": {"type": "bogus"}}}, "", "not a valid JSON Schema"),
    ({"dendrite": {"regex": "(unclosed"}}, "", "llguidance cannot compile this regex"),
    ({"dendrite": {"choices": []}}, "", "non-empty list"),
    ({"dendrite": {"shema": {}}}, "", "unknown constraint key 'shema'"),
    ({"dendrite": "json"}, "", "must be an object"),
    (None, "#| json_schema: $undefined_var\n", "not defined"),
    (None, "#| json_schema: {not json}\n", "not valid JSON"),
    (None, "#| regex: [a-z\n", "llguidance cannot compile"),
    (None, "#| colour: red\n", "unknown inline option"),
    (None, "#| regex: a+\n#| regex: b+\n", "given twice"),
    ({"dendrite": {"regex": "a+"}}, "#| regex: b+\n", "both in its metadata and in `#|` lines"),
])
def test_bad_constraints_refuse_and_change_nothing(ip, cell_metadata, metadata, inline, message):
    ip.user_ns["my_schema"] = SCHEMA
    cell_metadata(metadata)
    engine = current_engine()
    before = engine_state(engine)
    current_session().cell_source = inline + "%gen root -n 3"
    with pytest.raises(UsageError, match=message):
        magic(ip, "gen root -n 3")
    with pytest.raises(UsageError, match=message):
        magic(ip, "branch new --from root --gen 3", inline + "Answer in JSON:")
    assert engine_state(engine) == before


def test_a_constraint_on_a_cell_that_does_not_generate_is_refused(ip, cell_metadata):
    cell_metadata({"dendrite": {"regex": "a+"}})
    before = engine_state(current_engine())
    with pytest.raises(UsageError, match="does not generate"):
        magic(ip, "branch new", "text")
    assert engine_state(current_engine()) == before


def test_inline_options_are_stripped_from_the_prompt(ip):
    from dendrite_nb.magics.cell_options import split_inline_options

    options, body = split_inline_options('\n#| regex: \\d+\n#| choices: ["a"]\nThe prompt\n#| not an option')
    assert options == {"regex": "\\d+", "choices": '["a"]'}
    assert body == "The prompt\n#| not an option"
    assert split_inline_options("plain text") == ({}, "plain text")


def test_cells_run_through_the_shell_read_their_own_inline_options(ip):
    """pre_run_cell hands the session the raw cell, so a %gen line sees the `#|` lines above it."""
    ip.user_ns["my_schema"] = SCHEMA
    magic(ip, "fork root a b")
    with capture_output():
        result = ip.run_cell("#| json_schema: $my_schema\n%gen a -n 30")
    assert result.success and json.loads(result.result["a"]) in ({"answer": "yes"}, {"answer": "no"})
    with capture_output():
        result = ip.run_cell("%gen b -n 2 --ignore-eos")   # the next cell, without the option, is free
    assert result.success and len(result.result.tokens[0]) == 2


@pytest.mark.parametrize("metadata, inline", [({"dendrite": {"json_schema": SCHEMA}}, ""),
                                              (None, "#| json_schema: $my_schema\n"),
                                              ({"dendrite": {"choices": ["left", "right"]}}, "")])
def test_a_cell_constraint_drives_the_generation(ip, cell_metadata, metadata, inline):
    ip.user_ns["my_schema"] = SCHEMA
    cell_metadata(metadata)
    current_session().cell_source = inline + "%gen root/* -n 30"
    magic(ip, "fork root --n 3")
    result, _ = magic(ip, "gen root/* -n 30")
    for name, text in result.items():
        if "choices" in (metadata or {}).get("dendrite", {}):
            assert text in ("left", "right"), name
        else:
            assert json.loads(text) in ({"answer": "yes"}, {"answer": "no"}), name
    generated, _ = magic(ip, "branch pick --from root --gen 30", inline + "Pick one:")
    assert generated["pick"] in ("left", "right") or json.loads(generated["pick"])["answer"] in ("yes", "no")
    current_engine().audit()


def test_save_and_restore_a_session_through_the_magics(ip, tmp_path):
    magic(ip, "fork root a b")
    magic(ip, "gen a b -n 4 --ignore-eos")
    saved, _ = magic(ip, f"dendrite save {tmp_path / 's.dendrite'}")
    assert "saved 3 branches" in repr(saved)
    before = {name: b.tokens for name, b in current_engine().branches.items()}
    with pytest.raises(UsageError, match="--replace"):
        magic(ip, f"dendrite restore {tmp_path / 's.dendrite'}")
    with pytest.raises(UsageError, match="no save file"):
        magic(ip, f"dendrite restore {tmp_path / 'missing'} --replace")
    assert {name: b.tokens for name, b in current_engine().branches.items()} == before  # nothing changed
    loaded, _ = magic(ip, f"dendrite restore {tmp_path / 's.dendrite'} --replace")
    assert "restored" in repr(loaded)
    assert {name: b.tokens for name, b in current_engine().branches.items()} == before
    result, _ = magic(ip, "gen a -n 2 --ignore-eos")
    assert len(result.tokens[0]) == 2


def test_autosave_writes_after_every_nth_generating_cell(ip, tmp_path):
    target = tmp_path / "auto.dendrite"
    with pytest.raises(UsageError, match="--every takes a count"):
        magic(ip, f"dendrite autosave {target} --every 0")
    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError, match="afile' is a file, not a folder"):
        magic(ip, f"dendrite autosave {tmp_path / 'afile' / 'x' / 's.dendrite'}")
    assert current_session().autosave is None
    result, _ = magic(ip, f"dendrite autosave {target} --every 2")
    assert "after every 2 cells" in repr(result)
    magic(ip, "fork root a b")
    ip.run_cell("%gen a -n 2 --ignore-eos\n%gen b -n 2 --ignore-eos")  # one cell, two generations: counts once
    assert not target.exists()
    ip.run_cell("%fork a c")  # a cell that does not generate does not count
    assert not target.exists()
    ip.run_cell("%gen a b -n 2 --ignore-eos")
    assert target.exists()
    restored = Engine.restore(target)
    assert {n: b.tokens for n, b in restored.branches.items()} == {
        n: b.tokens for n, b in current_engine().branches.items()}
    magic(ip, "dendrite autosave off")
    assert current_session().autosave is None


def test_gen_sets_priorities_and_decodes_a_limited_batch(ip):
    magic(ip, "fork root a b c")
    before = engine_state(current_engine())
    for bad, message in (("--max-batch 0", "--max-batch takes a count"), ("--priority nan", "--priority takes a finite"),
                         ("-n 0 --priority 3", "--max-tokens takes a count")):
        with pytest.raises(UsageError, match=message):
            magic(ip, f"gen a b c {bad}")
    assert engine_state(current_engine()) == before and current_engine().branch("a").priority == 0.0
    magic(ip, "gen c -n 1 --priority 2 --ignore-eos")
    steps = []
    with current_engine().subscribe(lambda e: steps.append(e.branches) if isinstance(e, DecodeStep) else None):
        result, _ = magic(ip, "gen a b c -n 3 --max-batch 1 --ignore-eos")
    assert [len(t) for t in result.tokens] == [3, 3, 3]
    assert steps[:3] == [("c",), ("c",), ("c",)] and len(steps) == 9  # c ranks highest, one branch a step


def test_a_result_of_many_branches_shows_twenty_names_and_keeps_them_all(ip):
    """%fork root --n 1000 printed every child (22 KB); %prune root/* as much again."""
    forked, _ = magic(ip, "fork root --n 60")
    assert len(list(forked)) == 60 and repr(forked).count("root/") == 20 and "and 40 more" in repr(forked)
    pruned, _ = magic(ip, "prune root/*")
    assert len(list(pruned)) == 60 and "and 40 more" in repr(pruned)
    assert not [name for name in current_engine().branches if name.startswith("root/")]
