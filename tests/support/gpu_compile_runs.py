"""The sm_90 and sm_120 compiles of tests/kernels/test_gpu_compile.py, started as soon as collection has picked that
test, so that they run beside the rest of the session: each is a single-threaded process of minutes, and most
tests leave one of CI's two cores idle. They run at a lower priority (nice) so the tests in the foreground keep
their pace. The test waits for them, and tests/support/gpu_compile.py says what each one checks."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "gpu_compile.py"
ARCHS = (90, 120)
NICENESS = 10
_runs: dict[int, tuple[subprocess.Popen, object, object]] = {}
_folder: list[Path] = []  # the session's temporary folder, removed by stop()


def start() -> None:
    """Start both compiles (once per session); each in a fresh Triton cache (a cached kernel would pass
    without compiling), its output in temporary files."""
    if _runs:
        return
    folder = Path(tempfile.mkdtemp(prefix="gpu_compile_"))
    _folder.append(folder)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    for arch in ARCHS:
        env_arch = {**env, "TRITON_CACHE_DIR": str(folder / f"cache{arch}")}
        out, err = open(folder / f"sm{arch}.out", "w+"), open(folder / f"sm{arch}.err", "w+")
        process = subprocess.Popen([sys.executable, str(SCRIPT), "--arch", str(arch)], env=env_arch, stdout=out,
                                   stderr=err, text=True, preexec_fn=lambda: os.nice(NICENESS))
        _runs[arch] = (process, out, err)


def result(arch: int, timeout_s: float) -> subprocess.CompletedProcess:
    """Wait for one compile (starting both if collection did not) and return what it printed."""
    start()
    process, out, err = _runs[arch]
    process.wait(timeout=timeout_s)
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


def stop() -> None:
    """Kill what still runs (an interrupted session) and close the files."""
    for process, out, err in _runs.values():
        if process.poll() is None:
            process.kill()
            process.wait()
        out.close()
        err.close()
    _runs.clear()
    while _folder:
        shutil.rmtree(_folder.pop(), ignore_errors=True)
