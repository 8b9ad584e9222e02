"""`%dendrite serve` in an IPython shell: the server runs on the session's engine, its responses are branches the
magics take, `%gen` decodes in the server's batch, and the server stops when asked, replaced or when another
engine is loaded. Requests go through the real `openai` client over HTTP, on the tiny test checkpoint."""
import socket
import threading
import time

import httpx
import openai
import pytest
from IPython.core.error import UsageError

from dendrite_nb import DecodeStep, Engine, GenerationInterrupted, SamplingParams
from dendrite_nb.magics import current_engine, current_session
from dendrite_nb.magics.live import LiveGeneration

from tests.support.engines import engine_state
from tests.support.notebook_session import PROMPT, install_in_session, magic

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture
def served(shell, checkpoint):
    """The shell with a fresh engine (prompt in 'root') served on a free port; stopped afterwards."""
    install_in_session(Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4, debug=True))
    magic(shell, "branch root", PROMPT + "\n")
    serving, _ = magic(shell, "dendrite serve --port 0")
    yield shell, serving
    current_session().stop_server()


def client_for(url, api_key="unused"):
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)


def answers(url):
    """Whether something answers HTTP at url."""
    try:
        return httpx.get(f"{url}/models", timeout=5).status_code in (200, 401)
    except httpx.TransportError:
        return False


def test_a_response_is_a_branch_that_the_notebook_sees_forks_and_extends(served):
    ip, serving = served
    url = current_session().server.url
    assert serving.url == url and url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    assert f"OpenAI(base_url={url!r}, api_key='unused')" in repr(serving)
    assert "%dendrite serve stop" in repr(serving)
    status, _ = magic(ip, "dendrite status")
    assert f"server: {url}, 0 requests waiting, 0 responses kept" in repr(status)
    assert "prefix cache: on" in repr(status)

    view, _ = magic(ip, "tree")
    reply = client_for(url).completions.create(model="m", prompt="A river", max_tokens=6, temperature=0)
    engine = current_engine()
    assert reply.id in engine.branches
    assert engine.text(reply.id).endswith("A river" + reply.choices[0].text)
    # Live: the request's last step ended its row, and a generation's end passes the view's throttle at once.
    assert any(reply.id in node["label"] for node in view._nodes)
    shown, _ = magic(ip, f"show {reply.id}")
    assert shown.text == engine.text(reply.id)
    status, _ = magic(ip, "dendrite status")
    assert "1 response kept" in repr(status)

    magic(ip, f"fork {reply.id} mine")
    reference = engine.fork(reply.id, names=["reference"])[0]
    expected = engine.generate([reference], 5, GREEDY)[0]
    generated, _ = magic(ip, "gen mine -n 5 -t 0 --ignore-eos")
    assert list(generated.tokens[0]) == expected
    assert engine.branch("mine").tokens == reference.tokens
    magic(ip, f"prune {reply.id}")
    assert reply.id not in engine.branches and "mine" in engine.branches
    engine.audit()


def test_serve_stop_closes_the_port_and_gives_the_prefix_cache_back(served):
    ip, _ = served
    engine = current_engine()
    url = current_session().server.url
    reply = client_for(url).completions.create(model="m", prompt="A river", max_tokens=3, temperature=0)
    stopped, _ = magic(ip, "dendrite serve stop")
    assert repr(stopped) == f"stopped the server at {url}; the branches of its 1 kept response stay in the tree"
    assert not answers(url)
    assert current_session().server is None and engine.prefix_cache is False
    assert reply.id in engine.branches   # the notebook keeps working with what the server made
    status, _ = magic(ip, "dendrite status")
    assert "server: not running" in repr(status) and "prefix cache: off" in repr(status)
    again, _ = magic(ip, "dendrite serve stop")
    assert repr(again) == "no server was running"


def test_a_second_serve_is_refused_and_replace_stops_the_first(served):
    ip, _ = served
    first = current_session().server.url
    with pytest.raises(UsageError, match=r"a server is running already, at .*; stop it first \(%dendrite serve "
                                         r"stop\) or add --replace"):
        magic(ip, "dendrite serve --port 0")
    assert current_session().server.url == first and answers(first)
    replaced, _ = magic(ip, "dendrite serve --port 0 --replace")
    second = current_session().server.url
    assert second != first and repr(replaced).startswith(f"stopped the server at {first}\n")
    assert answers(second) and not answers(first)


def test_loading_or_restoring_another_engine_stops_the_server_first(served, checkpoint, tmp_path):
    ip, _ = served
    url = current_session().server.url
    magic(ip, f"dendrite load {checkpoint()} --num-blocks 32 --block-size 4 --replace")
    assert current_session().server is None and not answers(url)

    magic(ip, "dendrite serve --port 0")
    url = current_session().server.url
    magic(ip, f"dendrite save {tmp_path / 's.dendrite'}")
    magic(ip, f"dendrite restore {tmp_path / 's.dendrite'} --replace")
    assert current_session().server is None and not answers(url)


def test_bad_serve_options_are_refused_and_change_nothing(ip):
    engine = current_engine()
    before = engine_state(engine)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for line, message in ((f"--port {taken.getsockname()[1]}", "could not listen"),
                              ("--port 70000", "--port takes a port from 0 to 65535"),
                              ("--api-key ''", "--api-key is empty"),
                              ("--frob", "unrecognized arguments")):
            with pytest.raises(UsageError, match=message):
                magic(ip, f"dendrite serve {line}")
            assert current_session().server is None and engine.prefix_cache is False
            assert engine_state(engine) == before
    finally:
        taken.close()


def test_an_api_key_is_asked_for_and_not_shown(shell, checkpoint):
    install_in_session(Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4))
    try:
        serving, _ = magic(shell, "dendrite serve --port 0 --api-key s3cret")
        assert "s3cret" not in repr(serving) and "api_key='YOUR_KEY'" in repr(serving)
        with pytest.raises(openai.AuthenticationError):
            client_for(serving.url).models.list()
        assert len(client_for(serving.url, "s3cret").models.list().data) == 1
    finally:
        current_session().stop_server()


def test_gen_shares_the_servers_decode_steps_and_gives_what_it_gives_alone(served, monkeypatch):
    """An HTTP request and a %gen are made to wait for each other (the engine thread is held at a step boundary
    until both are queued), so their rows join the batch together: no timing decides whether they share a step."""
    ip, _ = served
    engine = current_engine()
    scheduler = current_session().server.scheduler
    magic(ip, "fork root mine alone")
    alone = engine.generate(["alone"], 12, GREEDY)[0]

    gate = threading.Event()
    held = scheduler.call(lambda _engine: gate.wait(60))
    submit = scheduler.submit

    def submit_then_open_the_gate(job):
        submit(job)
        if scheduler.waiting >= 2:
            gate.set()

    monkeypatch.setattr(scheduler, "submit", submit_then_open_the_gate)
    steps = []
    subscription = engine.subscribe(lambda event: steps.append(event.branches) if isinstance(event, DecodeStep)
                                    else None)
    streamed = {}
    client = client_for(current_session().server.url)

    def request():
        streamed["chunks"] = list(client.completions.create(model="m", prompt="A river", max_tokens=24,
                                                            temperature=0, stream=True))

    http = threading.Thread(target=request)
    http.start()
    deadline = time.monotonic() + 60
    while scheduler.waiting < 1:   # the request is queued behind the gate
        assert time.monotonic() < deadline, "the HTTP request never reached the scheduler"
        time.sleep(0.01)
    generated, _ = magic(ip, "gen mine -n 12 -t 0 --ignore-eos")
    http.join(60)
    subscription.close()
    held.result(60)

    response_id = streamed["chunks"][0].id
    assert any({"mine", response_id} <= set(branches) for branches in steps)
    assert scheduler.max_rows_seen >= 2
    assert list(generated.tokens[0]) == alone   # batch invariance: the same tokens as alone, greedy, float32
    engine.audit()


def test_ctrl_c_while_gen_waits_on_the_server_keeps_the_steps_done(served, monkeypatch):
    ip, _ = served
    engine = current_engine()
    magic(ip, "fork root mine")
    start = len(engine.branch("mine"))
    record = LiveGeneration.record
    calls = {"n": 0}

    def interrupted_at_the_third_step(self, *args):
        record(self, *args)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt   # as Ctrl-C lands in the cell's wait for the next update

    monkeypatch.setattr(LiveGeneration, "record", interrupted_at_the_third_step)
    with pytest.raises(GenerationInterrupted):
        magic(ip, "gen mine -n 200 -t 0 --ignore-eos")
    monkeypatch.undo()
    partial = current_session().last_result
    kept = len(partial.tokens[0])
    assert partial.interrupted and 3 <= kept < 200
    assert len(engine.branch("mine")) == start + kept   # every token the branch kept is in the result, no more
    reply = client_for(current_session().server.url).completions.create(model="m", prompt="A", max_tokens=2)
    assert reply.usage.completion_tokens >= 1   # the server goes on serving
    result, _ = magic(ip, "gen mine -n 2 -t 0 --ignore-eos")   # the branch left the batch: it can join again
    assert len(result.tokens[0]) == 2
    engine.audit()


def test_max_batch_is_refused_while_the_server_runs(served):
    ip, _ = served
    engine = current_engine()
    before = engine_state(engine)
    with pytest.raises(UsageError, match="--max-batch does not apply while the kernel's server runs"):
        magic(ip, "gen root -n 2 --max-batch 1")
    assert engine_state(engine) == before
