"""The OpenAI-compatible server, driven by the real `openai` client over HTTP, on the real demo model (CPU)."""
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from dendrite_nb.serve.server import Server

USER = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(demo_engine):
    engine = demo_engine(num_blocks=1024)
    running = Server(engine, port=0).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def engine_state(server):
    """The tree, the blocks and the cache, read on the engine thread between steps."""
    return server.scheduler.call(lambda e: (e.tree(), e.block_table(), e.num_free_blocks,
                                            e.num_cached_blocks)).result(60)


def wait_idle(server, timeout_s=60):
    """Until no request runs or waits on the engine thread (a cancelled one is freed at a step boundary)."""
    deadline = time.monotonic() + timeout_s
    while server.scheduler._running or server.scheduler.waiting:
        assert time.monotonic() < deadline, "the scheduler did not go idle"
        time.sleep(0.05)
    server.scheduler.call(lambda e: None).result(60)


def chat(client, **options):
    return client.chat.completions.create(model="m", messages=options.pop("messages", USER),
                                          temperature=options.pop("temperature", 0), **options)


def test_models_lists_the_checkpoint(client):
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_chat_streamed_and_not_say_the_same(client):
    whole = chat(client, max_tokens=24)
    assert whole.choices[0].message.content.strip()
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 24
    pieces, usage, reasons = [], None, []
    for chunk in chat(client, max_tokens=24, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert [r for r in reasons if r] == [whole.choices[0].finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # The second time, the whole prompt but its last token is in the tree already.
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1


def test_completions_streamed_and_not_say_the_same(client):
    whole = client.completions.create(model="m", prompt="The capital of France is", max_tokens=12, temperature=0)
    streamed = client.completions.create(model="m", prompt="The capital of France is", max_tokens=12,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    echoed = client.completions.create(model="m", prompt="The capital of France is", max_tokens=12, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The capital of France is" + whole.choices[0].text


def test_a_stop_string_ends_the_text_before_it(client):
    whole = chat(client, max_tokens=24).choices[0].message.content
    word = whole.split()[2]
    stopped = chat(client, max_tokens=24, stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == whole[:whole.index(word)]


def test_n_4_forks_with_logprobs_and_top_logprobs(client, server):
    reply = chat(client, max_tokens=8, n=4, temperature=0.8, seed=3, logprobs=True, top_logprobs=3)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert len(entries) == len([t for t in entries])
        assert "".join(e.token for e in entries).startswith(choice.message.content)
        for entry in entries:
            assert entry.logprob <= 0
            assert len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            assert entry.logprob <= tops[0] + 1e-5   # a sampled token is at most as likely as the likeliest
    greedy = chat(client, max_tokens=8, n=2, logprobs=True, top_logprobs=2)
    for entry in greedy.choices[0].logprobs.content:
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    # The prompt was prefilled once and forked: the choices are `<id>/<i>` branches of one node.
    names = server.scheduler.call(lambda e: sorted(n for n in e.branches if n.startswith(reply.id))).result(60)
    assert names == [f"{reply.id}/{i}" for i in range(4)]


def test_json_schema_outputs_validate(client):
    reply = chat(client, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120, n=3,
                 temperature=0.9, seed=5,
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    loose = chat(client, messages=[{"role": "user", "content": "Any JSON object."}], max_tokens=60,
                 response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_previous_response_id_reuses_the_whole_first_turn(client, server):
    first = client.responses.create(model="m", input="Name a colour.", max_output_tokens=12, temperature=0)
    second = client.responses.create(model="m", input="And another one?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    whole_first_turn = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens == whole_first_turn
    assert second.usage.input_tokens > whole_first_turn
    # Each response id names a branch: the second is a fork of the first's node, so they share its KV.
    tree = server.scheduler.call(lambda e: e.tree()).result(60)
    assert first.id in tree["branches"] and second.id in tree["branches"]
    # A chat continues a chat completion the same way, through x-dendrite-parent.
    one = chat(client, max_tokens=8)
    two = chat(client, messages=[{"role": "user", "content": "And of Spain?"}], max_tokens=8,
               extra_body={"x-dendrite-parent": one.id})
    assert two.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens + one.usage.completion_tokens


def test_delete_prunes_a_response(client, server):
    reply = chat(client, max_tokens=4)
    assert reply.id in server.scheduler.call(lambda e: set(e.branches)).result(60)
    deleted = httpx.delete(f"{server.url}/chat/completions/{reply.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert reply.id not in server.scheduler.call(lambda e: set(e.branches)).result(60)
    assert httpx.delete(f"{server.url}/chat/completions/{reply.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        chat(client, max_tokens=4, extra_body={"x-dendrite-parent": reply.id})


def test_a_client_that_hangs_up_mid_stream_frees_its_branch(server):
    wait_idle(server)
    free_before = engine_state(server)[2:]
    body = {"model": "m", "messages": USER, "max_tokens": 400, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        next(line for line in lines if line.startswith("data: "))   # some content is flowing
    wait_idle(server)
    names = server.scheduler.call(lambda e: set(e.branches)).result(60)
    assert first["id"] not in names
    tree, _, free, cached = engine_state(server)
    assert free + cached == sum(free_before)   # the KV it took is free again (or cache that can be evicted)
    server.scheduler.call(lambda e: e.audit()).result(60)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "m", "messages": USER, "guided_json": {"type": "object"}}, 400, "guided_json"),
    ({"model": "m", "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strictness": True}}}, 400, "response_format.json_schema.strictness"),
    ({"model": "m", "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, 400, "response_format.json_schema.schema"),
    ({"model": "m", "messages": USER, "n": 0}, 400, "n"),
    ({"model": "m", "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "m", "messages": "hi"}, 400, "messages"),
    ({"model": "m", "messages": USER, "max_tokens": 9000}, 400, "messages"),
    ({"model": "m", "messages": USER, "x-dendrite-parent": "chatcmpl-nope"}, 404, "x-dendrite-parent"),
])
def test_bad_requests_get_an_openai_error_and_change_nothing(server, body, status, param):
    wait_idle(server)
    before = engine_state(server)
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    wait_idle(server)
    assert engine_state(server) == before


def test_a_request_past_the_context_says_the_numbers(server):
    response = httpx.post(f"{server.url}/completions", json={"model": "m", "prompt": "hi " * 9000, "max_tokens": 4})
    assert response.status_code == 400
    assert "8,192" in response.json()["error"]["message"]


def test_bad_json_is_a_400(server):
    response = httpx.post(f"{server.url}/chat/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_a_full_waiting_line_answers_429_and_loses_nothing(demo_engine):
    engine = demo_engine(num_blocks=256)
    server = Server(engine, port=0, max_waiting=1).start()
    try:
        gate = threading.Event()
        server.scheduler.call(lambda e: gate.wait(60))   # the engine thread is busy: requests queue
        results = {}

        def send(key):
            results[key] = httpx.post(f"{server.url}/chat/completions", timeout=120, json={
                "model": "m", "messages": USER, "max_tokens": 4, "temperature": 0})

        first = threading.Thread(target=send, args=("first",))
        first.start()
        deadline = time.monotonic() + 30
        while server.scheduler.waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        send("second")   # the line holds one: refused at once
        gate.set()
        first.join(120)
        assert results["second"].status_code == 429
        assert results["second"].json()["error"]["code"] == "rate_limit_exceeded"
        assert results["first"].status_code == 200   # the one that waited was served
    finally:
        server.stop()


def test_an_api_key_is_required_when_set(demo_engine):
    engine = demo_engine(num_blocks=64)
    server = Server(engine, port=0, api_key="sesame").start()
    try:
        assert httpx.get(f"{server.url}/models").status_code == 401
        assert httpx.get(f"{server.url}/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    finally:
        server.stop()
    assert not server.running


def test_a_seed_gives_the_same_choices_again(client):
    first = chat(client, max_tokens=10, n=2, temperature=1.0, seed=11)
    again = chat(client, max_tokens=10, n=2, temperature=1.0, seed=11)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


def test_a_new_schema_compiles_once_for_its_request(client, monkeypatch):
    import llguidance

    from tests.engine.test_constraint_options import CountingMatcher

    counting = CountingMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    schema = {"title": "compiled once, by the server", "type": "object",
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    reply = chat(client, max_tokens=16, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "n", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["n"] in range(10)
    assert len(counting.compiles) == 1   # checked by the handler, then started for the request: one compile
