"""The README's first command: the demo runs on the embedded model from a clean cache."""
import os
import subprocess
import sys


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
