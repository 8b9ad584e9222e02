"""Imports point one way: the engine never imports the notebook layer, widgets never import magics."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_MODULES = ("IPython", "ipykernel", "ipywidgets", "anywidget", "traitlets", "dendrite_nb.magics",
                    "dendrite_nb.widgets", "magics", "widgets")


# `%load_ext dendrite_nb` calls these two functions of the engine package; they import the notebook
# layer inside their bodies, only when IPython asks. Nothing else in dendrite_nb/ may.
EXTENSION_ENTRY_POINTS = {"load_ipython_extension", "unload_ipython_extension"}


def imports_in(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def imported_modules(folder: Path):
    for path in folder.rglob("*.py"):
        module = ast.parse(path.read_text())
        if path == ROOT / "dendrite_nb" / "__init__.py":
            module.body = [node for node in module.body
                           if not (isinstance(node, ast.FunctionDef) and node.name in EXTENSION_ENTRY_POINTS)]
        yield from ((path, name) for name in imports_in(module))


def offending(folder: Path, forbidden: tuple[str, ...]):
    return [f"{path.relative_to(ROOT)} imports {name}" for path, name in imported_modules(folder)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_engine_never_imports_the_notebook_layer():
    assert offending(ROOT / "dendrite_nb", NOTEBOOK_MODULES) == []


def test_importing_the_engine_loads_no_notebook_module():
    import subprocess
    import sys

    code = ("import sys, dendrite_nb; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('IPython', 'ipykernel', 'anywidget') "
            "or m.startswith(('dendrite_nb.magics', 'dendrite_nb.widgets'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_widgets_never_import_magics():
    assert offending(ROOT / "widgets", ("dendrite_nb.magics", "magics", "IPython.core.magic")) == []
