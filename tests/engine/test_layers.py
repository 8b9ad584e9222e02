"""Imports point one way: the engine never imports the notebook layer, widgets never import magics."""
import ast
import os
from pathlib import Path

from tests.support.imports import imported_modules as modules_imported_by

ROOT = Path(__file__).resolve().parents[2]
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


def test_importing_the_engine_or_the_nbval_plugin_loads_no_kernel_and_not_triton():
    """Triton decides at a kernel's definition whether it runs in the CPU interpreter, so the kernels must load
    only once something runs them: pytest loads the nbval plugin (and with it dendrite_nb) before the tests'
    conftest turns the interpreter on. A module-level import of a kernel under distributed/ once broke every
    interpreted kernel test in CI this way."""
    import subprocess
    import sys

    code = ("import sys, dendrite_nb, dendrite_nb.magics.nbval_plugin; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('dendrite_nb.kernels')))")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env=environment).stdout
    assert loaded.strip() == "[]"


def test_widgets_never_import_magics():
    assert offending(ROOT / "widgets", ("dendrite_nb.magics", "magics", "IPython.core.magic")) == []


# The engine's parts, as groups of modules: imports between groups must form no cycle (issue 40).
GROUPS = {"engine": ("dendrite_nb.engine",), "kv": ("dendrite_nb.kv",), "attention": ("dendrite_nb.attention",),
          "persist": ("dendrite_nb.persist", "dendrite_nb.persist_schema", "dendrite_nb.persist_write")}


def group_of(module: str) -> str | None:
    return next((group for group, prefixes in GROUPS.items()
                 if any(module == p or module.startswith(p + ".") for p in prefixes)), None)


def test_no_import_cycle_between_engine_kv_attention_and_persist():
    edges: dict[str, set[str]] = {group: set() for group in GROUPS}
    for path in (ROOT / "dendrite_nb").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        source = group_of(module.removesuffix(".__init__"))
        if source is None:
            continue
        for name in modules_imported_by(path, ROOT):
            target = group_of(name)
            if target is not None and target != source:
                edges[source].add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start])

    assert [group for group in GROUPS if reaches(group, group, set())] == [], edges


def test_the_notebook_layer_uses_only_the_public_engine():
    """magics/ and widgets/ reach no engine internals: not its branch tree, its pool, nor a private attribute."""
    internal = {"branch_tree", "pool", "allocator"}
    found = []
    for folder in ("magics", "widgets"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and (node.attr in internal or (
                        node.attr.startswith("_") and not node.attr.startswith("__")
                        and isinstance(node.value, ast.Name) and node.value.id in ("engine", "eng"))):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert found == []
