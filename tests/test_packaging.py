"""A wheel of the project holds every package of its source tree: pyproject's list of packages names each folder
with an __init__.py. (An editable install maps whole folders, so a package left out of the list still imports
there; an installed wheel would lack it, as one lacked dendrite_nb.distributed.)"""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_of_the_source_tree():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(ROOT / folder).parts)))
    assert found - {"dendrite_nb.magics", "dendrite_nb.widgets"} and set(setuptools["packages"]) == found
