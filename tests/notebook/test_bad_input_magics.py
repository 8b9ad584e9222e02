"""Bad input to the magics: each call gets a one-line UsageError that says what was wrong, and the session's
engine is exactly as it was (tree, block table, free blocks, and each branch's constraint and priority).
Found by an audit of the notebook layer; before it, these calls raised raw tracebacks, were taken silently or
with another meaning, or were refused after they had changed the engine."""
import datetime
import re

import pytest
import torch
from IPython.core.error import UsageError

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.magics import current_engine, current_session

from tests.support.engines import engine_state
from tests.support.notebook_session import magic

NO_HOME = "~nosuchuser_dendrite_audit"  # a user with no home directory: Path.expanduser cannot resolve it


def settings(engine):
    """What engine_state leaves out: each branch's constraint and priority."""
    return {name: (None if b.constraint is None else b.constraint.describe(), b.priority)
            for name, b in engine.branches.items()}


def refused(ip, line, message, cell=None):
    """`%line` is a UsageError matching `message`, and the session keeps the same engine, exactly as it was."""
    engine = current_engine()
    before = engine_state(engine), settings(engine)
    with pytest.raises(UsageError, match=message):
        magic(ip, line, cell)
    assert current_session().engine is engine and not engine.closed
    assert (engine_state(engine), settings(engine)) == before
    engine.audit()


class FakeKernel:
    """What ipykernel offers the magics: the execute_request being handled, with the cell's metadata."""

    def __init__(self, metadata):
        self.metadata = metadata

    def get_parent(self, channel="shell"):
        return {"metadata": self.metadata, "content": {}}


# ---- quoting ---------------------------------------------------------------------------------------------
def _stop_string(ip, tmp_path, monkeypatch):
    seen = []
    real_generate = Engine.generate

    def recording_generate(self, branches, max_new_tokens=32, sampling=None, *args, **kwargs):
        seen.append(sampling.stop)
        return real_generate(self, branches, max_new_tokens, sampling, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", recording_generate)
    magic(ip, 'gen root -n 2 --stop "."')   # the example in %gen?
    assert seen == [(".",)]


def _save_path(ip, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "my run.dendrite"
    magic(ip, f'dendrite save "{target}"')
    assert target.is_file() and list(cwd.iterdir()) == []


def _branch_name(ip, tmp_path, monkeypatch):
    magic(ip, 'branch "my plan" --from root', " carefully")
    assert "my plan" in current_engine().branches and '"my plan"' not in current_engine().branches


@pytest.mark.parametrize("case", [_stop_string, _save_path, _branch_name], ids=["stop", "save path", "branch name"])
def test_quotes_group_an_argument_and_are_not_part_of_it(ip, tmp_path, monkeypatch, case):
    """`--stop "."` stops at a period, `save "a b.dendrite"` writes that file, `%%branch "my plan"` names the branch
    my plan: the quotes are not kept in the value (IPython's arg_split keeps them unless told posix=True)."""
    case(ip, tmp_path, monkeypatch)


# ---- sampling options --------------------------------------------------------------------------------------
def test_an_infinite_temperature_is_refused(ip):
    """`--temperature inf` is refused as --priority inf is: logits / inf are all 0, so top-k and top-p cut nothing."""
    refused(ip, "gen root -n 3 --temperature inf --top-k 1", "temperature")


@pytest.mark.parametrize("line", ["branch root --seed 5", "branch kid --from root -t 0.2"])
def test_sampling_options_of_a_cell_that_does_not_generate_are_refused(ip, line):
    """Sampling options on a %%branch without --gen would be ignored: refused with a pointer to --gen, as a
    constraint on such a cell is."""
    refused(ip, line, "--gen", cell=" and then")


# ---- constraints ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, cell", [("gen root -n 3 --priority 5", None), ("branch kid --from root --gen 3", "x")])
def test_a_constraint_llguidance_cannot_run_changes_nothing(ip, monkeypatch, line, cell):
    """A regex that passes validation but breaks llguidance's lexer on the first token is refused with nothing
    changed: no token appended, no constraint or priority left on the branch, no new branch left behind."""
    monkeypatch.setattr(ip, "kernel", FakeKernel({"dendrite": {"regex": "a{1000000}"}}), raising=False)
    refused(ip, line, "regex|grammar", cell=cell)
    assert "kid" not in current_engine().branches


def test_a_json_schema_variable_that_is_not_json_is_a_usage_error(ip, monkeypatch):
    """`#| json_schema: $var` holding a value JSON cannot encode (a date default) is a UsageError naming the
    problem, not json's TypeError traceback."""
    monkeypatch.setitem(ip.user_ns, "audit_schema", {"type": "string", "default": datetime.date(2024, 1, 1)})
    refused(ip, "branch kid --from root --gen 3", "JSON|json", cell="#| json_schema: $audit_schema\nAnswer:")


# ---- %dendrite -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line", [f"dendrite save {NO_HOME}/s.dendrite", f"dendrite restore {NO_HOME}/s.dendrite --replace",
                                  f"dendrite autosave {NO_HOME}/s.dendrite", f"dendrite load {NO_HOME}/model --replace"])
def test_a_path_under_an_unknown_home_is_a_usage_error(ip, line):
    """`~user/...` for a user with no home is a UsageError naming the path, not pathlib's RuntimeError traceback."""
    refused(ip, line, "nosuchuser_dendrite_audit")
    assert current_session().autosave is None


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("subcommand, device", [
    pytest.param("load", "cuda", marks=NO_CUDA), pytest.param("restore", "cuda", marks=NO_CUDA),
    ("load", "meta"), ("restore", "meta"),
])
def test_a_device_that_cannot_run_the_model_is_a_usage_error(ip, checkpoint, tmp_path, subcommand, device):
    """--device cuda without CUDA, or the data-less meta device, is a UsageError naming the device, not torch's
    AssertionError / NotImplementedError (or, for load, an engine that fails at its first forward), and the
    engine in use stays."""
    saved = tmp_path / "s.dendrite"
    magic(ip, f"dendrite save {saved}")
    source = checkpoint() if subcommand == "load" else saved
    refused(ip, f"dendrite {subcommand} {source} --device {device} --replace --num-blocks 16", device)


@pytest.mark.parametrize("subcommand", ["load", "restore"])
def test_a_pool_larger_than_memory_is_a_usage_error(ip, checkpoint, tmp_path, subcommand):
    """--num-blocks past what the device can hold is a UsageError naming --num-blocks, not the allocator's
    RuntimeError traceback; the engine in use stays."""
    saved = tmp_path / "s.dendrite"
    magic(ip, f"dendrite save {saved}")
    source = checkpoint() if subcommand == "load" else saved
    refused(ip, f"dendrite {subcommand} {source} --replace --num-blocks {10**15}", "num.blocks")


def test_restore_refuses_num_blocks_zero(ip, tmp_path):
    """`%dendrite restore FILE --num-blocks 0` is refused as load and demo refuse it, not silently ignored."""
    saved = tmp_path / "s.dendrite"
    magic(ip, f"dendrite save {saved}")
    refused(ip, f"dendrite restore {saved} --replace --num-blocks 0", "num.blocks")


def test_autosave_to_a_folder_is_refused(ip, tmp_path):
    """`%dendrite autosave FOLDER` is refused when given, as `%dendrite save FOLDER` is, not accepted and then
    warned about after every generating cell."""
    refused(ip, f"dendrite autosave {tmp_path}", "folder")
    assert current_session().autosave is None


def test_autosave_makes_missing_folders_as_save_does(ip, tmp_path):
    """`%dendrite autosave new/folder/s.dendrite` is taken, and its first save makes the folders, as
    `%dendrite save` does (it used to be refused while save went ahead)."""
    target = tmp_path / "new" / "folder" / "s.dendrite"
    magic(ip, f"dendrite autosave {target}")
    assert not target.parent.exists()
    ip.run_cell("%gen root -n 1 --ignore-eos")
    assert target.is_file()
    magic(ip, f"dendrite save {tmp_path / 'other' / 's.dendrite'}")
    assert (tmp_path / "other" / "s.dendrite").is_file()


def test_branch_from_a_completed_grammar_with_gen_leaves_no_branch_behind(ip):
    """`%%branch kid --from root --gen 4` on a root whose grammar is complete is refused, and 'kid' (forked before
    the generation's checks) is gone again."""
    engine = current_engine()
    engine.constrain("root", {"choices": ["yes"]})
    engine.generate(["root"], 8, SamplingParams(temperature=0.0))
    assert engine.branch("root").matcher.is_stopped()
    before = engine_state(engine)
    with pytest.raises(UsageError, match="completed"):
        magic(ip, "branch kid --from root --gen 4 -t 0", "\n")
    assert "kid" not in engine.branches
    assert engine_state(engine) == before
    engine.audit()


def test_dendrite_save_to_a_directory_is_a_usage_error(ip, tmp_path):
    """A one-line UsageError naming the folder, not an IsADirectoryError traceback."""
    engine = current_engine()
    before = engine_state(engine)
    with pytest.raises(UsageError, match=re.escape(str(tmp_path))):
        magic(ip, f"dendrite save {tmp_path}")
    assert engine_state(engine) == before


def test_dendrite_load_with_an_unknown_device_is_a_usage_error(ip, checkpoint):
    """A one-line UsageError, not torch.device's RuntimeError traceback; the engine in use stays."""
    engine = current_engine()
    with pytest.raises(UsageError, match="bogus"):
        magic(ip, f"dendrite load {checkpoint()} --device bogus --replace")
    assert current_session().engine is engine and not engine.closed


def test_demo_with_a_cache_that_is_a_file_is_a_usage_error(ip, tmp_path, monkeypatch):
    """`%dendrite demo --replace` with DENDRITE_NB_CACHE naming a file: a UsageError naming the variable, not a
    FileExistsError traceback; the engine in use stays."""
    cache = tmp_path / "cache"
    cache.write_text("")
    monkeypatch.setenv("DENDRITE_NB_CACHE", str(cache))
    refused(ip, "dendrite demo --replace", "DENDRITE_NB_CACHE.*not a folder")
