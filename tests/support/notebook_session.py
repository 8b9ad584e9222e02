"""The magics' session and shell, as the notebook tests drive them."""
from IPython.utils.capture import capture_output

PROMPT = "The river is wide and cold. First idea:"   # the notebook tests' `ip` fixture puts it in branch 'root'


def install_in_session(engine, source="test"):
    """Stop the notebook session's server, close its engine (and its views), then make `engine` the session's, as a
    fresh kernel would hold it: no autosave."""
    from dendrite_nb.magics import current_session

    session = current_session()
    session.stop_server()
    if session.engine is not None:
        session.close_views()
        session.engine.close()
    session.engine = None
    session.autosave = None
    session.install(engine, source, False)


def magic(ip, line, cell=None):
    """Run `%line` (or `%%line` with a cell) and keep what it displayed."""
    name, _, rest = line.partition(" ")
    with capture_output() as captured:
        result = ip.run_cell_magic(name, rest, cell) if cell is not None else ip.run_line_magic(name, rest)
    return result, captured


class FakeKernel:
    """What ipykernel offers the magics: the execute_request being handled, with the cell's metadata (JupyterLab
    sends the cell's id there as "cellId")."""

    def __init__(self, metadata):
        self.metadata = metadata

    def get_parent(self, channel="shell"):
        return {"metadata": self.metadata, "content": {}}
