"""Fixtures of the notebook tests: IPython's test shell with the magics loaded, and it with a small engine."""
import pytest
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

from dendrite_nb import Engine

from tests.support.notebook_session import PROMPT, install_in_session


@pytest.fixture(scope="module")
def shell():
    ip = start_ipython() or get_ipython()   # the global test shell, made once per process
    ip.run_line_magic("load_ext", "dendrite_nb")
    return ip


@pytest.fixture
def ip(shell, checkpoint):
    """The shell with a fresh small engine on the tiny test checkpoint, a prompt in branch 'root', no autosave."""
    install_in_session(Engine.from_pretrained(checkpoint(), num_blocks=48, block_size=4, debug=True))
    shell.run_cell_magic("branch", "root", PROMPT + "\n")
    shell.user_ns.pop("my_schema", None)
    return shell
