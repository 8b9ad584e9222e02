"""The README's first command: the demo runs on the embedded model from a clean cache."""
import os
import subprocess
import sys

import pytest


def test_demo_runs_end_to_end(tmp_path):
    env = {**os.environ, "DENDRITE_NB_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "dendrite_nb", "demo", "--tokens", "6", "--branches", "4"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "forked 4 branches" in result.stdout and "(a fork copies no KV)" in result.stdout
    assert "audit: refcounts, free list and node invariants OK" in result.stdout
    assert (tmp_path / "demo-llama-v1" / "model.safetensors").is_file()


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
