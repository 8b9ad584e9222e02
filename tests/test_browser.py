"""The three live views in a real browser: JupyterLab on localhost, headless Chromium, one notebook
that loads the demo model, grows a tree and shows %tree, %blocks and %throughput.

It asserts on what the page shows: one SVG node per tree node with the engine's labels, every
painted block cell in the colour of its reader count (or free), one plotted point per decode step,
updates arriving while a cell is still running, a click selecting a branch that Python then reads,
and both JupyterLab themes. Screenshots land in $DENDRITE_ARTIFACTS (default build/browser-artifacts).
"""
import os
from pathlib import Path

import pytest

from dendrite_nb.widgets import node_label
from lab_session import (cell_errors, chromium_page, jupyter_lab, open_notebook, read_json, run_all_cells,
                         run_cell, write_notebook)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("DENDRITE_ARTIFACTS", ROOT / "build" / "browser-artifacts"))
LONG_STEPS = 600   # the generation the views are watched during

CELLS = [
    "%load_ext dendrite_nb",
    "%dendrite demo",
    "%%branch prompt\nThree ways to cross a river without a bridge:",
    "%fork prompt --n 3\n%gen prompt/* -n 12",
    "%fork prompt/0 a b",
    "%tree",
    "%blocks",
    "%throughput",
    f"%gen a b -n {LONG_STEPS} --ignore-eos",
    # What the page must show, written where the test can read it.
    "import json\n"
    "from dendrite_nb.magics import current_engine, current_session\n"
    "engine, session = current_engine(), current_session()\n"
    "json.dump({'tree': engine.tree(), 'blocks': engine.block_table(), 'steps': len(session.history),\n"
    "           'selected': session.tree_view().selected, 'outlined': session.block_table_view().selected},\n"
    "          open('expected.json', 'w'))",
]
TREE_CELL, BLOCKS_CELL, THROUGHPUT_CELL, LONG_CELL, EXPECTED_CELL = 5, 6, 7, 8, 9

# Page-side readers of each view --------------------------------------------------------------------
TREE_NODES = """() => [...document.querySelectorAll('.dendrite-tree-view g.dendrite-node')].map(g => ({
    id: Number(g.dataset.nodeId), label: g.querySelector('text.dendrite-label').textContent,
    selected: g.dataset.selected === 'true'}))"""

# For every block: the RGB at its cell's centre, and (for the outline) at the middle of its right edge,
# next to the legend's colours, all read from the pixels the page actually painted.
BLOCK_PIXELS = """() => {
    const canvas = document.querySelector('.dendrite-blocks-view canvas');
    const [columns, pitch, cell, numBlocks] = ['columns', 'pitch', 'cell', 'numBlocks'].map(k => Number(canvas.dataset[k]));
    const ratio = canvas.width / canvas.clientWidth;
    const context = canvas.getContext('2d');
    const rgb = (x, y) => Array.from(context.getImageData(Math.floor(x * ratio), Math.floor(y * ratio), 1, 1).data.slice(0, 3));
    const parse = (css) => css.match(/\\d+/g).slice(0, 3).map(Number);
    const legend = {};
    document.querySelectorAll('.dendrite-blocks-view .dendrite-swatch[data-readers]').forEach(s => {
        legend[s.dataset.readers] = parse(getComputedStyle(s).backgroundColor);
    });
    const view = document.querySelector('.dendrite-blocks-view');
    const selectedColour = getComputedStyle(view).getPropertyValue('--dendrite-selected').trim();
    const cells = [];
    for (let i = 0; i < Number(numBlocks); i++) {
        const left = (i % columns) * pitch, top = Math.floor(i / columns) * pitch;
        cells.push({ centre: rgb(left + cell / 2, top + cell / 2), edge: rgb(left + cell - 1, top + cell / 2) });
    }
    return { legend, cells, selectedColour };
}"""

PLOT_POINTS = """() => {
    const trace = document.querySelector('.dendrite-throughput-view .scatterlayer .trace');
    return trace ? trace.querySelectorAll('path.point').length : -1;
}"""

# Samples what the views show every 25 ms while a cell runs, entirely inside the page.
START_SAMPLING = """() => {
    window.__dendriteSamples = [];
    window.__dendriteSampler = setInterval(() => {
        const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
        const trace = document.querySelector('.dendrite-throughput-view .scatterlayer .trace');
        const summary = document.querySelector('.dendrite-tree-view .dendrite-summary');
        window.__dendriteSamples.push({ busy: indicator && indicator.dataset.status === 'busy',
            points: trace ? trace.querySelectorAll('path.point').length : -1,
            tree: summary ? summary.textContent : '' });
    }, 25);
}"""
STOP_SAMPLING = "() => { clearInterval(window.__dendriteSampler); return window.__dendriteSamples; }"


def expected_colour(legend: dict, readers: int) -> list[int]:
    return legend[str(min(readers, 5))]


def hex_rgb(colour: str) -> list[int]:
    colour = colour.lstrip("#")
    return [int(colour[i:i + 2], 16) for i in (0, 2, 4)]


def check_block_pixels(painted: dict, blocks: dict, selected_table: list[int]) -> list[str]:
    readers = {b["id"]: b["readers"] for b in blocks["blocks"]}
    problems = []
    for block_id, cell in enumerate(painted["cells"]):
        want = expected_colour(painted["legend"], readers.get(block_id, 0))
        if cell["centre"] != want:
            problems.append(f"block {block_id}: painted {cell['centre']}, legend says {want}")
    for block_id in selected_table:
        if painted["cells"][block_id]["edge"] != hex_rgb(painted["selectedColour"]):
            problems.append(f"block {block_id} of the selected branch is not outlined: its edge is "
                            f"{painted['cells'][block_id]['edge']}, the outline colour {painted['selectedColour']}")
    return problems


def luminance(rgb: list[int]) -> float:
    return (0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]) / 255


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    write_notebook(root / "views.ipynb", CELLS)
    with jupyter_lab(root) as url:
        yield url, root


def test_the_three_views_show_the_engine_state_live_in_jupyterlab(lab):
    url, root = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with chromium_page() as page:
        open_notebook(page, url, "views.ipynb")
        page.evaluate(START_SAMPLING)
        run_all_cells(page, timeout_s=300)
        samples = page.evaluate(STOP_SAMPLING)
        assert cell_errors(page) == []
        expected = read_json(root / "expected.json")
        page.wait_for_function(f"() => ({PLOT_POINTS})() === {expected['steps']}", timeout=30_000)
        page.screenshot(path=str(ARTIFACTS / "views-light.png"), full_page=True)

        # The tree: one SVG node per tree node, labelled as the engine's branches say.
        shown = page.evaluate(TREE_NODES)
        assert sorted(n["id"] for n in shown) == sorted(n["id"] for n in expected["tree"]["nodes"])
        labels = {n["id"]: node_label(n) for n in expected["tree"]["nodes"]}
        assert {n["id"]: n["label"] for n in shown} == labels
        assert {"a", "b", "prompt/1", "prompt/2"} <= set(labels.values())

        # The block table: every painted cell in its legend colour, free cells in the free colour.
        painted = page.evaluate(BLOCK_PIXELS)
        assert len(painted["cells"]) == expected["blocks"]["num_blocks"]
        assert check_block_pixels(painted, expected["blocks"], []) == []

        # The throughput plot: one point per decode step of the latest generation.
        assert expected["steps"] == LONG_STEPS and page.evaluate(PLOT_POINTS) == LONG_STEPS

        # Live: while the long %gen cell was still running, the plot already had some of its steps.
        during = [s["points"] for s in samples if s["busy"] and 0 < s["points"] < LONG_STEPS]
        assert len(set(during)) >= 2, f"no live updates seen while the cell ran: {samples[-20:]}"

        # A click on node 'a' selects it: the tree marks it, the block table outlines its blocks,
        # and Python reads the selection.
        page.click(".dendrite-tree-view g.dendrite-node:has(text.dendrite-label:text-is('a')) circle")
        page.wait_for_function("() => document.querySelector(\".dendrite-tree-view g.dendrite-node[data-selected='true']\")")
        run_cell(page, EXPECTED_CELL, timeout_s=60)
        expected = read_json(root / "expected.json")
        assert expected["selected"] == "a" and expected["outlined"] == "a"
        page.wait_for_timeout(300)
        painted = page.evaluate(BLOCK_PIXELS)
        assert check_block_pixels(painted, expected["blocks"], expected["blocks"]["branches"]["a"]) == []
        for name, cell_index in (("tree", TREE_CELL), ("blocks", BLOCKS_CELL), ("throughput", THROUGHPUT_CELL)):
            page.locator(".jp-Cell").nth(cell_index).locator(".jp-OutputArea").screenshot(
                path=str(ARTIFACTS / f"{name}.png"))

        # The dark theme: labels stay readable and the canvas repaints in the dark palette.
        page.evaluate("() => { window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'}); }")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
        page.wait_for_timeout(500)
        label_rgb = page.evaluate("""() => getComputedStyle(document.querySelector('.dendrite-tree-view text.dendrite-label'))
                                        .fill.match(/\\d+/g).slice(0, 3).map(Number)""")
        assert luminance(label_rgb) > 0.6, label_rgb
        painted = page.evaluate(BLOCK_PIXELS)
        assert luminance(painted["legend"]["0"]) < 0.35   # free cells are dark on a dark page
        assert check_block_pixels(painted, expected["blocks"], expected["blocks"]["branches"]["a"]) == []
        page.screenshot(path=str(ARTIFACTS / "views-dark.png"), full_page=True)
