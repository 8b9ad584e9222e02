"""What a source file imports, read from its syntax tree (for the layering tests)."""
from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(path: Path, root: Path) -> set[str]:
    """Absolute names `path` (under `root`) imports, relative imports resolved against its package; each name
    imported by `from X import name` also counts as the module X.name (it may be one)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names
