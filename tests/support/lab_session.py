"""A JupyterLab server and a headless Chromium page driving it, for the `browser` tests.

Chromium comes from the system (Debian's `chromium` package) and is driven by Playwright through
`executable_path`: Playwright's own browser download is never used. Every wait has a deadline, so
a wedged browser fails the test with a message instead of hanging the suite.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TOKEN = "dendrite-browser-test"
STEP_TIMEOUT_MS = 60_000        # any single browser operation
SERVER_START_TIMEOUT_S = 90


def chromium_path() -> str | None:
    """DENDRITE_CHROMIUM if it names an executable, else `chromium` on the PATH."""
    chosen = os.environ.get("DENDRITE_CHROMIUM")
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_requirements() -> list[str]:
    """What this machine lacks for the browser tests (empty when they can run)."""
    missing = []
    if chromium_path() is None:
        missing.append("Chromium: `apt-get install chromium`, or set DENDRITE_CHROMIUM to a Chromium binary "
                       f"(DENDRITE_CHROMIUM={os.environ.get('DENDRITE_CHROMIUM', 'unset')})")
    for module, package in (("playwright", "playwright"), ("jupyterlab", "jupyterlab")):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{package} (`pip install -e '.[test]'`)")
    return missing


def write_notebook(path: Path, sources: list[str]) -> None:
    import nbformat   # here, not at the top: conftest imports this module on machines without nbformat too

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Settings of the test's own JupyterLab (never the user's): start the notebook's kernel without
# asking, and no news or update checks (the machine may be offline).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
}


def _write_lab_settings(folder: Path) -> None:
    for plugin, values in LAB_SETTINGS.items():
        path = folder / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextmanager
def jupyter_lab(root: Path) -> Iterator[str]:
    """Serve `root` with JupyterLab on a free localhost port; yields the base URL. Its workspace and
    settings live under `root`, so a test never changes the user's JupyterLab (theme, open tabs)."""
    _write_lab_settings(root / ".lab-settings")
    port = _free_port()
    log_path = root / "jupyterlab.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
             f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
             "--allow-root", f"--LabApp.workspaces_dir={root / '.lab-workspaces'}",
             f"--LabApp.user_settings_dir={root / '.lab-settings'}"],
            stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while True:
                try:
                    urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"JupyterLab did not start; its log:\n{log_path.read_text()[-3000:]}")
                    time.sleep(0.5)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


@contextmanager
def chromium_page(viewport=(1400, 1000)):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), timeout=STEP_TIMEOUT_MS,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.set_default_timeout(STEP_TIMEOUT_MS)
            yield page
        finally:
            browser.close()


def open_notebook(page, url: str, name: str) -> None:
    """Open `name` in JupyterLab and wait until its kernel is idle."""
    page.goto(f"{url}/lab?reset&token={TOKEN}")   # reset: no tabs restored from an earlier test
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('docmanager:open')")
    page.evaluate("(path) => { window.jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'}); }", name)
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.wait_for_function("""(path) => {
        const status = document.querySelector('.jp-Notebook-ExecutionIndicator');
        const panel = [...window.jupyterapp.shell.widgets('main')].find(w => w.context?.path === path);
        return status && status.dataset.status === 'idle'
            && panel?.sessionContext.session?.kernel?.connectionStatus === 'connected';
    }""", arg=name)


def run_all_cells(page, timeout_s: float) -> None:
    # Started, not awaited: page.evaluate has no timeout of its own, and the command's promise
    # settles only when every cell has run.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    wait_until_executed(page, timeout_s)


def run_cell(page, name: str, index: int, timeout_s: float) -> None:
    """Run one cell (0-based) of notebook `name` as a user would with Shift-Enter on it."""
    page.evaluate("""([path, index]) => {
        const panel = [...window.jupyterapp.shell.widgets('main')].find(w => w.context?.path === path);
        window.jupyterapp.shell.activateById(panel.id);
        panel.content.activeCellIndex = index;
        window.jupyterapp.commands.execute('notebook:run-cell');
    }""", [name, index])
    wait_until_executed(page, timeout_s)


def wait_until_executed(page, timeout_s: float) -> None:
    """Until no cell shows `[*]` and the kernel is idle."""
    page.wait_for_function("""() => {
        const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
        const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
        return prompts.length && prompts.every(p => /^\\[\\d+\\]:$/.test(p))
            && indicator && indicator.dataset.status === 'idle';
    }""", timeout=timeout_s * 1000, polling=200)


def cell_errors(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
        "els => els.map(e => e.textContent)")


def read_json(path: Path, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return json.loads(path.read_text())
