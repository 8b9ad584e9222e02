"""Imports point one way: the engine never imports the notebook layer, widgets never import magics."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_MODULES = ("IPython", "ipykernel", "ipywidgets", "anywidget", "traitlets", "dendrite_nb.magics",
                    "dendrite_nb.widgets", "magics", "widgets")


def imported_modules(folder: Path):
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                yield from ((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, node.module


def offending(folder: Path, forbidden: tuple[str, ...]):
    return [f"{path.relative_to(ROOT)} imports {name}" for path, name in imported_modules(folder)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_engine_never_imports_the_notebook_layer():
    assert offending(ROOT / "dendrite_nb", NOTEBOOK_MODULES) == []


def test_widgets_never_import_magics():
    assert offending(ROOT / "widgets", ("dendrite_nb.magics", "magics", "IPython.core.magic")) == []
