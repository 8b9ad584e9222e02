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

from tests.support.lab_session import (cell_errors, chromium_page, jupyter_lab, open_notebook, read_json,
                                       run_all_cells, run_cell, write_notebook)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("DENDRITE_ARTIFACTS", ROOT / "build" / "browser-artifacts"))
LONG_STEPS = 200   # the generation the views are watched during: seconds of steps, each view updated many times

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

# Compares every painted block cell with the engine's block table, inside the page (one read of the
# canvas pixels): the centre of cell i must be the legend's colour for its reader count (0 = free),
# and each block of the selected branch must carry the outline colour on its right edge.
CHECK_BLOCKS = """([readers, selected]) => {
    const view = [...document.querySelectorAll('.dendrite-blocks-view')].pop();
    const canvas = view.querySelector('canvas');
    const [columns, pitch, cell, numBlocks] = ['columns', 'pitch', 'cell', 'numBlocks'].map(k => Number(canvas.dataset[k]));
    const ratio = canvas.width / canvas.clientWidth;
    const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    const rgb = (x, y) => { const at = 4 * (Math.floor(y * ratio) * canvas.width + Math.floor(x * ratio));
                            return [pixels[at], pixels[at + 1], pixels[at + 2]].join(','); };
    const parse = (css) => css.match(/\\d+/g).slice(0, 3).join(',');
    const legend = {};
    view.querySelectorAll('.dendrite-swatch[data-readers]').forEach(s => { legend[s.dataset.readers] = parse(getComputedStyle(s).backgroundColor); });
    const hex = getComputedStyle(view).getPropertyValue('--dendrite-selected').trim();
    const outline = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16)).join(',');
    const problems = [];
    const at = (i) => [(i % columns) * pitch, Math.floor(i / columns) * pitch];
    if (numBlocks !== readers.length) problems.push(`the canvas has ${numBlocks} cells, the pool ${readers.length} blocks`);
    for (let i = 0; i < readers.length && problems.length < 20; i++) {
        const [left, top] = at(i);
        const want = legend[String(Math.min(readers[i], 5))], got = rgb(left + cell / 2, top + cell / 2);
        if (got !== want) problems.push(`block ${i} (${readers[i]} readers): painted ${got}, legend ${want}`);
    }
    for (const i of selected) {
        const [left, top] = at(i);
        const got = rgb(left + cell - 1, top + cell / 2);
        if (got !== outline) problems.push(`block ${i} of the selected branch: edge ${got}, outline ${outline}`);
    }
    return { problems, legend, paintMs: Number(canvas.dataset.paintMs) };
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


def readers_per_block(blocks: dict) -> list[int]:
    readers = [0] * blocks["num_blocks"]
    for block in blocks["blocks"]:
        readers[block["id"]] = block["readers"]
    return readers


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
        readers = readers_per_block(expected["blocks"])
        assert page.evaluate(CHECK_BLOCKS, [readers, []])["problems"] == []

        # The throughput plot: one point per decode step of the latest generation.
        assert expected["steps"] == LONG_STEPS and page.evaluate(PLOT_POINTS) == LONG_STEPS

        # Live: while the long %gen cell was still running, the plot already had some of its steps.
        during = [s["points"] for s in samples if s["busy"] and 0 < s["points"] < LONG_STEPS]
        assert len(set(during)) >= 2, f"no live updates seen while the cell ran: {samples[-20:]}"

        # Hovering node 'a' shows its tokens, blocks and text tail; ▾ on prompt/0 folds a and b away.
        node_a = ".dendrite-tree-view g.dendrite-node:has(text.dendrite-label:text-is('a'))"
        page.hover(f"{node_a} circle")
        tip = page.locator(".dendrite-tree-view .dendrite-tooltip")
        tip.wait_for(state="visible")
        a = next(n for n in expected["tree"]["nodes"] if n["branches"] == ["a"])
        assert "branches: a" in tip.text_content()
        assert f"tokens: {a['num_tokens']:,}" in tip.text_content()
        assert f"blocks: {', '.join(map(str, a['blocks'][:24]))}" in tip.text_content()
        fold = ".dendrite-tree-view g.dendrite-node:has(text.dendrite-label:text-is('prompt/0')) text.dendrite-toggle"
        page.click(fold)
        page.wait_for_function(f"() => ({TREE_NODES})().length === {len(shown) - 2}")
        page.click(fold)
        page.wait_for_function(f"() => ({TREE_NODES})().length === {len(shown)}")

        # A click on node 'a' selects it: the tree marks it, the block table outlines its blocks,
        # and Python reads the selection.
        page.click(f"{node_a} circle")
        page.wait_for_function("() => document.querySelector(\".dendrite-tree-view g.dendrite-node[data-selected='true']\")")
        run_cell(page, "views.ipynb", EXPECTED_CELL, timeout_s=60)
        expected = read_json(root / "expected.json")
        assert expected["selected"] == "a" and expected["outlined"] == "a"
        page.wait_for_timeout(300)
        outlined = expected["blocks"]["branches"]["a"]
        assert page.evaluate(CHECK_BLOCKS, [readers, outlined])["problems"] == []
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
        dark = page.evaluate(CHECK_BLOCKS, [readers, outlined])
        assert dark["problems"] == []
        assert luminance([int(c) for c in dark["legend"]["0"].split(",")]) < 0.35   # free cells dark on a dark page
        page.screenshot(path=str(ARTIFACTS / "views-dark.png"), full_page=True)


BIG_POOL_CELLS = [
    "from dendrite_nb import Engine, SamplingParams\n"
    "from dendrite_nb.testing import demo_checkpoint\n"
    "from dendrite_nb.widgets import BlockTableView\n"
    "engine = Engine.from_pretrained(demo_checkpoint(), num_blocks=100_000, block_size=1)\n"
    "engine.new_branch('doc', 'A long shared document. ' * 20)\n"
    "engine.generate(engine.fork('doc', 64), 40, SamplingParams(ignore_eos=True))\n"
    "BlockTableView(engine)",
    "import json\n"
    "json.dump(engine.block_table(), open('big_expected.json', 'w'))",
]


def test_a_100k_block_pool_paints_every_cell_quickly(lab):
    url, root = lab
    write_notebook(root / "big_pool.ipynb", BIG_POOL_CELLS)
    with chromium_page() as page:
        open_notebook(page, url, "big_pool.ipynb")
        run_all_cells(page, timeout_s=300)
        assert cell_errors(page) == []
        blocks = read_json(root / "big_expected.json")
        page.wait_for_function("() => document.querySelector('.dendrite-blocks-view canvas')?.dataset.paintMs")
        result = page.evaluate(CHECK_BLOCKS, [readers_per_block(blocks), []])
        assert result["problems"] == []
        # One paint of 100,000 cells must fit well inside a frame budget of a few frames.
        assert result["paintMs"] < 100, result["paintMs"]
        page.locator(".dendrite-blocks-view").screenshot(path=str(ARTIFACTS / "blocks-100k.png"))
