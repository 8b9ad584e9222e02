"""The real `openai` client against the protocol layer, with no engine and no HTTP server: an httpx transport
hands each request the client sends to our parsers and answers with our builders' bodies and SSE streams. So
the SDK's own requests (structured outputs from a pydantic model included) parse, and what we send back parses
into the SDK's objects through its own streaming and error handling."""
import json

import httpx
import openai
import pydantic
import pytest

from dendrite_nb.serve.protocol import (SSE_DONE, APIError, ChatChunks, ChoiceResult, CompletionChunks,
                                        ResponseEvents, TokenLogprob, Usage, chat_completion_body, completion_body,
                                        parse_chat_request, parse_completion_request, parse_responses_request,
                                        read_json, response_body, sse_data, sse_error, sse_event)

USAGE = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=6)


class Person(pydantic.BaseModel):
    name: str
    age: int


class FakeServer:
    """Answers every choice with the same canned tokens (`pieces`: text and log-prob), ending for `reason`;
    keeps each parsed request in `seen`. With `fail_after_first_chunk`, a chat stream breaks off with an error."""

    def __init__(self, pieces=(("Hel", -0.1), ("lo", -0.2), ("!", -0.3)), reason="eos"):
        self.pieces, self.reason, self.seen, self.fail_after_first_chunk = pieces, reason, [], False

    def tokens(self, top: int) -> tuple[TokenLogprob, ...]:
        return tuple(TokenLogprob(text, logprob, top=(TokenLogprob(text, logprob), TokenLogprob("x", -5.0))[:top])
                     for text, logprob in self.pieces)

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        route = {"/v1/chat/completions": (parse_chat_request, self.chat),
                 "/v1/completions": (parse_completion_request, self.completion),
                 "/v1/responses": (parse_responses_request, self.response)}[request.url.path]
        try:
            parsed = route[0](read_json(request.content))
        except APIError as error:
            return httpx.Response(error.status, json=error.body())
        self.seen.append(parsed)
        answer = route[1](parsed)
        if isinstance(answer, dict):
            return httpx.Response(200, json=answer)
        return httpx.Response(200, content="".join(answer).encode(), headers={"content-type": "text/event-stream"})

    def chat(self, request):
        logprobs = self.tokens(request.top_logprobs) if request.logprobs else None
        if not request.stream:
            return chat_completion_body(completion_id="chatcmpl-1", model=request.model, created=1, usage=USAGE,
                                        choices=[ChoiceResult(self.text, self.reason, logprobs)] * request.n)
        chunks, sent = ChatChunks("chatcmpl-1", request.model, 1), []
        for index in range(request.n):
            sent.append(sse_data(chunks.role(index)))
            for position, (text, _) in enumerate(self.pieces):
                sent.append(sse_data(chunks.content(index, text, logprobs and logprobs[position:position + 1])))
                if self.fail_after_first_chunk:
                    return sent + [sse_error(APIError("the engine stopped", code="engine_error", status=500,
                                                      error_type="server_error"))]
            sent.append(sse_data(chunks.finish(index, self.reason)))
        return sent + ([sse_data(chunks.usage(USAGE))] if request.include_usage else []) + [SSE_DONE]

    def completion(self, request):
        echo = (TokenLogprob("<0>", None),)   # every prompt echoed as one token, which nothing predicts
        generated = self.tokens(request.logprobs or 0)
        logprobs = (echo + generated if request.echo else generated) if request.logprobs is not None else None
        prefix = echo[0].token if request.echo else ""
        if not request.stream:
            return completion_body(completion_id="cmpl-1", model=request.model, created=1, usage=USAGE,
                                   choices=[ChoiceResult(prefix + self.text, self.reason, logprobs)]
                                   * request.num_choices)
        chunks, sent = CompletionChunks("cmpl-1", request.model, 1), []
        for index in range(request.num_choices):
            sent.append(sse_data(chunks.text(index, prefix + self.text, logprobs, self.reason)))
        return sent + ([sse_data(chunks.usage(USAGE))] if request.include_usage else []) + [SSE_DONE]

    def response(self, request):
        ids = {"response_id": "resp_2", "model": request.model, "created_at": 1}
        if not request.stream:
            return response_body(request, **ids, message_id="msg_2", text=self.text, reason=self.reason, usage=USAGE)
        events = ResponseEvents(request, **ids, message_id="msg_2")
        sent = events.start() + [events.delta(text) for text, _ in self.pieces] + events.finish(self.reason, USAGE)
        return [sse_event(event_type, payload) for event_type, payload in sent]


@pytest.fixture
def server():
    return FakeServer()


@pytest.fixture
def client(server):
    return openai.OpenAI(api_key="none", base_url="http://dendrite.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(server)))


def test_chat(client, server):
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], n=2,
                                           logprobs=True, top_logprobs=2, temperature=0, seed=3)
    assert [choice.message.content for choice in reply.choices] == ["Hello!", "Hello!"]
    assert reply.choices[1].index == 1 and reply.choices[0].finish_reason == "stop"
    assert [t.token for t in reply.choices[0].logprobs.content] == ["Hel", "lo", "!"]
    assert [t.token for t in reply.choices[0].logprobs.content[0].top_logprobs] == ["Hel", "x"]
    assert reply.usage.prompt_tokens_details.cached_tokens == 6
    assert server.seen[0].n == 2 and server.seen[0].sampling.greedy and server.seen[0].sampling.seed == 3


def test_chat_stream(client):
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                            stream_options={"include_usage": True}, logprobs=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello!"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "Hi"}]) as helper:
        assert helper.get_final_completion().choices[0].message.content == "Hello!"


def test_chat_structured_output_from_a_pydantic_model(client, server):
    server.pieces, server.reason = (('{"name":', -0.1), ('"Ann","age":3}', -0.2)), "grammar_complete"
    reply = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Hi"}],
                                          response_format=Person)
    assert reply.choices[0].message.parsed == Person(name="Ann", age=3)
    schema = server.seen[0].constraint_spec["json_schema"]   # the SDK's strict schema, accepted by llguidance
    assert schema["properties"].keys() == {"name", "age"} and schema["additionalProperties"] is False


def test_completions(client, server):
    reply = client.completions.create(model="m", prompt=[[1, 2], [3]], n=2, logprobs=1, echo=True, max_tokens=3)
    assert len(reply.choices) == 4 and reply.choices[3].text == "<0>Hello!"
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["<0>", "Hel", "lo", "!"] and logprobs.token_logprobs[0] is None
    assert logprobs.text_offset == [0, 3, 6, 8] and logprobs.top_logprobs[1] == {"Hel": -0.1}
    assert server.seen[0].prompts == ((1, 2), (3,)) and server.seen[0].max_new_tokens == 3
    streamed = list(client.completions.create(model="m", prompt="Once", stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[0].choices[0].text == "Hello!" and streamed[0].choices[0].finish_reason == "stop"
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 6


def test_responses(client, server):
    reply = client.responses.create(model="m", input="Hi", instructions="Be brief.", previous_response_id="resp_1")
    assert reply.output_text == "Hello!" and reply.status == "completed"
    assert reply.usage.input_tokens_details.cached_tokens == 6 and reply.previous_response_id == "resp_1"
    assert server.seen[0].previous_response_id == "resp_1" and server.seen[0].instructions == "Be brief."
    with client.responses.stream(model="m", input=[{"role": "user", "content": "Hi"}]) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        assert deltas == ["Hel", "lo", "!"] and stream.get_final_response().output_text == "Hello!"


def test_responses_structured_output(client, server):
    server.pieces = (('{"name":"Bo","age":', -0.1), ("40}", -0.2))
    reply = client.responses.parse(model="m", input="Hi", text_format=Person)
    assert reply.output_parsed == Person(name="Bo", age=40)
    assert server.seen[0].constraint_spec["json_schema"]["required"] == ["name", "age"]


def test_responses_stream_out_of_tokens(client, server):
    server.reason = "max_tokens"
    events = list(client.responses.create(model="m", input="Hi", stream=True, max_output_tokens=3))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_bad_request_reaches_the_client_as_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"guided_json": {"type": "object"}})
    assert caught.value.status_code == 400 and caught.value.param == "guided_json"
    assert caught.value.code == "unsupported_parameter" and "response_format" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="Hi", max_output_tokens=0)
    assert caught.value.param == "max_output_tokens" and server.seen == []


def test_error_mid_stream_raises_in_the_client(client, server):
    server.fail_after_first_chunk = True
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True)
    with pytest.raises(openai.APIError, match="the engine stopped"):
        list(stream)


def test_every_body_is_valid_json(server):
    """What goes on the wire never holds NaN or Infinity, which json.dumps writes by default."""
    server.pieces = (("a", float("-inf")),)
    body = server.chat(parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                           "logprobs": True, "top_logprobs": 1}))
    assert json.loads(json.dumps(body, allow_nan=False))["choices"][0]["logprobs"]["content"][0]["logprob"] == -9999
