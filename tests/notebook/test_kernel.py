"""The magics in a real kernel, driven over ZeroMQ by jupyter_client as JupyterLab drives them:
execute_requests that carry cell metadata, and Kernel > Interrupt in the middle of a generation."""
import signal
import time

import pytest

from tests.support.kernel_client import TIMEOUT_S, execute, running_kernel, text_of

jupyter_client = pytest.importorskip("jupyter_client")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def kernel():
    with running_kernel() as (manager, client):
        yield manager, client


@pytest.fixture(scope="module")
def loaded(kernel, checkpoint):
    """The kernel with the tiny test model (the demo's real one would spend this file's time loading)."""
    _, client = kernel
    for code in ("%load_ext dendrite_nb", f"%dendrite load {checkpoint()} --num-blocks 256",
                 "%%branch root\nA river blocks the road."):
        reply, outputs = execute(client, code)
        assert reply["status"] == "ok", text_of(outputs)
    return kernel


def tree_of(client):
    reply, outputs = execute(client, "from dendrite_nb.magics import current_engine as _ce\nprint(_ce().tree())")
    assert reply["status"] == "ok", text_of(outputs)
    return text_of(outputs)


def test_a_json_schema_in_cell_metadata_reaches_the_magic(loaded):
    _, client = loaded
    before = tree_of(client)
    reply, outputs = execute(client, "%gen root -n 4", metadata={"dendrite": {"json_schema": {"type": "bogus"}}})
    assert reply["status"] == "error" and reply["ename"] == "UsageError"
    assert "not a valid JSON Schema" in reply["evalue"] and "cell metadata" in reply["evalue"]
    assert "Traceback" not in text_of(outputs)  # a UsageError shows its message only
    assert tree_of(client) == before

    execute(client, "%fork root --n 1")
    reply, outputs = execute(client, "r = %gen root/0 -n 30\nprint(r['root/0'])",
                             metadata={"dendrite": {"json_schema": SCHEMA}, "cellId": "c1"})
    assert reply["status"] == "ok", text_of(outputs)
    assert text_of(outputs).strip().splitlines()[-1] in ('{"answer":"yes"}', '{"answer":"no"}')

    reply, outputs = execute(client, "%gen root -n 4 --ignore-eos")
    assert reply["status"] == "ok", text_of(outputs)
    assert "1 branch, 4 new tokens, 4 steps" in text_of(outputs)
    assert any(kind == "update_display_data" for kind, _ in outputs)  # streamed in place


def test_kernel_interrupt_stops_at_a_step_boundary_and_the_next_cell_works(loaded):
    manager, client = loaded
    reply, outputs = execute(client, "from dendrite_nb.magics import current_engine\n"
                                     "start = len(current_engine().branch('root'))")
    assert reply["status"] == "ok", text_of(outputs)
    reply, outputs = execute(client, "%gen root -n 1900 --ignore-eos",
                             on_first_display=lambda: (time.sleep(0.3), manager.interrupt_kernel()))
    assert reply["status"] == "error" and reply["ename"] == "GenerationInterrupted", text_of(outputs)
    assert "interrupted at" in text_of(outputs)

    reply, outputs = execute(client, "from dendrite_nb.magics import current_session\n"
                                     "e = current_engine(); e.audit(); r = current_session().last_result\n"
                                     "print(len(e.branch('root')) - start, r.steps, r.interrupted, len(r.tokens[0]))")
    assert reply["status"] == "ok", text_of(outputs)
    grown, steps, interrupted, kept = text_of(outputs).split()
    assert interrupted == "True" and 0 < int(steps) < 1900 and int(grown) == int(steps) == int(kept)

    reply, outputs = execute(client, "%gen root -n 3 --ignore-eos")
    assert reply["status"] == "ok" and "3 new tokens" in text_of(outputs)


# The same session, grown in a kernel and in this process: a forked tree with sampled branches.
GROW = """
from dendrite_nb import SamplingParams
from dendrite_nb.magics import current_engine
eng = current_engine()
trunk = eng.new_branch("trunk", "A river blocks the road. The bridge is")
eng.generate([trunk], 3, SamplingParams(temperature=0.0, ignore_eos=True))
eng.generate(eng.fork(trunk, 3), 5, SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True))
"""
CONTINUE = """
import torch
from dendrite_nb import SamplingParams
from dendrite_nb.magics import current_engine
eng = current_engine()
names = ["trunk/0", "trunk/1", "trunk/2"]
tokens = eng.generate(names, 6, SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True))
torch.save({"tokens": tokens, "logits": eng.next_logits(names)}, OUT)
"""


def test_a_session_saved_in_one_kernel_continues_exactly_in_a_new_one(checkpoint, tmp_path):
    """Save, kill the kernel process, start a new kernel, restore, continue: the tokens and logits equal
    those of the same session run without interruption (in this process)."""
    import torch

    from dendrite_nb.magics import current_session
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    load = f"%load_ext dendrite_nb\n%dendrite load {checkpoint()} --num-blocks 64 --block-size 4"
    saved, after_restore = tmp_path / "session.dendrite", tmp_path / "restored.pt"
    def run_in_new_kernel(cells, before_shutdown=None):
        with running_kernel() as (manager, client):
            for code in cells:
                reply, outputs = execute(client, code)
                assert reply["status"] == "ok", text_of(outputs)
            if before_shutdown:
                before_shutdown(manager)

    def kill(manager):  # SIGKILL: the process dies at once, nothing but the file survives
        manager.signal_kernel(signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT_S
        while manager.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not manager.is_alive()

    run_in_new_kernel([load, GROW, f"%dendrite save {saved}"], before_shutdown=kill)
    run_in_new_kernel(["%load_ext dendrite_nb", f"%dendrite restore {saved}",
                       f"OUT = {str(after_restore)!r}\n" + CONTINUE])

    ip = start_ipython() or get_ipython()
    session = current_session()
    previous = session.engine
    session.engine = None
    uninterrupted = tmp_path / "uninterrupted.pt"
    try:
        ip.run_line_magic("load_ext", "dendrite_nb")
        ip.run_line_magic("dendrite", f"load {checkpoint()} --num-blocks 64 --block-size 4")
        exec(GROW, {})
        exec(CONTINUE, {"OUT": str(uninterrupted)})
    finally:
        if session.engine is not None:
            session.engine.close()
        session.engine = previous
    restored, expected = torch.load(after_restore), torch.load(uninterrupted)
    assert restored["tokens"] == expected["tokens"]
    assert torch.equal(restored["logits"], expected["logits"])
