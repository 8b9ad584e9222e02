"""The OpenAI wire protocol (dendrite_nb/serve/protocol*.py): requests of every shape parsed, every kind of bad
request refused with a 400 naming the field, and the bodies, chunks and events we build validated against the
`openai` SDK's own pydantic types, which is what the SDK parses them into."""
import copy
import json

import pydantic
import pytest
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from dendrite_nb import parse_constraint
from dendrite_nb.constraints import JSON_SCHEMA_OPTIONS
from dendrite_nb.serve import wire
from dendrite_nb.serve.protocol import (ACCEPTED_WITHOUT_EFFECT, NOT_SUPPORTED, SSE_DONE, APIError, ChatChunks,
                                        ChoiceResult, CompletionChunks, Message, ResponseEvents, TokenLogprob, Usage,
                                        chat_completion_body, completion_body, finish_reason,
                                        parse_chat_request, parse_completion_request, parse_responses_request,
                                        read_json, response_body, sse_data, sse_error, sse_event)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "Hi"}]
PARSERS = {"completions": parse_completion_request, "chat": parse_chat_request, "responses": parse_responses_request}
MINIMAL = {"completions": {"model": "m", "prompt": "Once"}, "chat": {"model": "m", "messages": USER},
           "responses": {"model": "m", "input": "Hi"}}
BODIES = {"completions": wire.CompletionBody, "chat": wire.ChatBody, "responses": wire.ResponsesBody}


def exact(model: type[pydantic.BaseModel], payload: dict) -> pydantic.BaseModel:
    """payload validated as the SDK's type, with no field the type lacks anywhere inside: the SDK's models keep
    unknown fields quietly, so a misspelt field name would otherwise pass."""
    parsed = model.model_validate(payload)
    pending = [("", parsed)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, pydantic.BaseModel):
            assert not item.model_extra, f"{model.__name__}{where} has fields its SDK type lacks: {item.model_extra}"
            pending.extend((f"{where}.{name}", getattr(item, name)) for name in type(item).model_fields)
        elif isinstance(item, list):
            pending.extend((f"{where}[{i}]", value) for i, value in enumerate(item))
    return parsed


def refused(endpoint: str, body) -> APIError:
    before = copy.deepcopy(body)
    with pytest.raises(APIError) as caught:
        PARSERS[endpoint](body)
    assert body == before, "parsing changed the request body"
    error = caught.value
    assert error.status == 400 and set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.body()["error"]["type"] == "invalid_request_error"
    return error


# ---- requests: valid shapes ----

@pytest.mark.parametrize("prompt, prompts", [
    ("Once upon", ("Once upon",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
])
def test_completion_prompt_shapes(prompt, prompts):
    request = parse_completion_request({"model": "m", "prompt": prompt, "n": 2})
    assert request.prompts == prompts and request.num_choices == 2 * len(prompts)


def test_completion_defaults_and_fields():
    default = parse_completion_request(MINIMAL["completions"])
    assert (default.n, default.max_new_tokens, default.logprobs, default.echo, default.stream) == (1, 16, None, False,
                                                                                                    False)
    assert default.sampling.temperature == 1.0 and default.sampling.top_p == 1.0 and default.parent is None
    request = parse_completion_request({
        "model": "m", "prompt": "x", "n": 3, "max_tokens": 40, "temperature": 0, "top_p": 0.9, "stop": "\n",
        "seed": 7, "logprobs": 5, "echo": True, "stream": True, "stream_options": {"include_usage": True},
        "user": "u1", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
        "x-dendrite-parent": "cmpl-abc"})
    assert (request.n, request.max_new_tokens, request.logprobs, request.echo) == (3, 40, 5, True)
    assert request.sampling.greedy and request.sampling.top_p == 0.9 and request.sampling.stop == ("\n",)
    assert request.sampling.seed == 7 and request.stream and request.include_usage and request.parent == "cmpl-abc"


@pytest.mark.parametrize("endpoint", PARSERS)
def test_min_p_reaches_the_sampling_settings(endpoint):
    """vLLM's min_p, which OpenAI's clients send through extra_body, on every endpoint that samples."""
    request = PARSERS[endpoint]({**MINIMAL[endpoint], "min_p": 0.05, "top_p": 0.9})
    assert (request.sampling.min_p, request.sampling.top_p) == (0.05, 0.9)


def test_chat_messages_roles_and_parts():
    request = parse_chat_request({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Rule 1."}, {"type": "text", "text": "Rule 2."}]},
        {"role": "user", "content": "Hi", "name": "ann"},
        # an SDK's reply object sent back as it came
        {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None, "function_call": None,
         "audio": None, "annotations": []},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]})
    assert request.messages == (Message("system", "Be brief."), Message("system", "Rule 1.\nRule 2."),
                                Message("user", "Hi"), Message("assistant", "Hello"), Message("tool", "42"))


def test_chat_sampling_logprobs_and_tokens():
    request = parse_chat_request({"model": "m", "messages": USER, "n": 4, "max_completion_tokens": 9,
                                  "temperature": 0.7, "top_p": 0.5, "stop": ["a", "b", "c", "d"], "seed": 1,
                                  "logprobs": True, "top_logprobs": 20, "stream": True,
                                  "stream_options": {"include_usage": True}, "x-dendrite-parent": "chatcmpl-1"})
    assert (request.n, request.max_new_tokens, request.logprobs, request.top_logprobs) == (4, 9, True, 20)
    assert request.sampling.stop == ("a", "b", "c", "d") and request.sampling.temperature == 0.7
    assert request.include_usage and request.parent == "chatcmpl-1" and request.constraint_spec is None
    assert request.sampling.min_p == 0.0  # off unless asked
    assert parse_chat_request({"model": "m", "messages": USER, "max_tokens": 5}).max_new_tokens == 5
    unbounded = parse_chat_request(MINIMAL["chat"])
    assert unbounded.max_new_tokens is None and not unbounded.logprobs and unbounded.top_logprobs == 0


@pytest.mark.parametrize("response_format, options, spec", [
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, None, {"json_schema": {"type": "object"}}),
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True,
                                             "description": "a person"}}, None, {"json_schema": SCHEMA}),
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
     {"lenient": True, "coerce_one_of": False}, {"json_schema": SCHEMA, "lenient": True, "coerce_one_of": False}),
])
def test_chat_response_format_gives_the_engine_spec(response_format, options, spec):
    body = {"model": "m", "messages": USER, "response_format": response_format}
    if options is not None:
        body["x-dendrite-schema-options"] = options
    request = parse_chat_request(body)
    assert request.constraint_spec == spec
    if spec is not None:
        assert parse_constraint(request.constraint_spec).kind == "json_schema"


def test_schema_options_are_the_engines():
    assert set(wire.SchemaOptions.model_fields) == set(JSON_SCHEMA_OPTIONS)


def test_a_schema_llguidance_refuses_passes_with_lenient():
    schema = {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    body = {"model": "m", "messages": USER, "response_format": {"type": "json_schema",
                                                                "json_schema": {"name": "x", "schema": schema}}}
    assert refused("chat", body).param == "response_format.json_schema.schema"
    lenient = parse_chat_request({**body, "x-dendrite-schema-options": {"coerce_one_of": True}})
    assert lenient.constraint_spec == {"json_schema": schema, "coerce_one_of": True}


def test_responses_input_shapes():
    simple = parse_responses_request({"model": "m", "input": "Hi", "instructions": "Be brief.",
                                      "previous_response_id": "resp_1", "max_output_tokens": 30, "store": False})
    assert simple.messages == (Message("user", "Hi"),) and simple.instructions == "Be brief."
    assert simple.previous_response_id == "resp_1" and simple.max_new_tokens == 30 and simple.store is False
    assert simple.constraint_spec is None and simple.text_format == {"type": "text"}
    items = parse_responses_request({"model": "m", "input": [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        # a previous response's output item, sent back as it came
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]},
        {"type": "message", "role": "user", "content": "d"},
    ]})
    assert items.messages == (Message("system", "Rules."), Message("user", "a\nb"), Message("assistant", "c"),
                              Message("user", "d"))


@pytest.mark.parametrize("text_format, spec", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_schema": {"type": "object"}}),
    ({"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}, {"json_schema": SCHEMA}),
])
def test_responses_text_format(text_format, spec):
    request = parse_responses_request({"model": "m", "input": "Hi", "text": {"format": text_format}})
    assert request.constraint_spec == spec and request.text_format == text_format


def test_fields_accepted_without_effect():
    chat = parse_chat_request({**MINIMAL["chat"], "user": "u", "metadata": {"k": "v"}, "store": True,
                               "parallel_tool_calls": False, "prompt_cache_key": "k", "safety_identifier": "s",
                               "tools": [], "tool_choice": "none", "presence_penalty": 0, "frequency_penalty": 0,
                               "logit_bias": None, "stream": True,
                               "stream_options": {"include_usage": False, "include_obfuscation": False}})
    assert chat == parse_chat_request({**MINIMAL["chat"], "stream": True})
    top_level = {name for model in BODIES.values() for name in model.model_fields}
    documented = {name for name in ACCEPTED_WITHOUT_EFFECT if name in top_level}
    assert documented == {"user", "metadata", "store", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}


@pytest.mark.parametrize("endpoint", PARSERS)
def test_not_supported_fields_say_so(endpoint):
    declared = {field.alias or name for name, field in BODIES[endpoint].model_fields.items()}
    for name in set(NOT_SUPPORTED) - declared:
        error = refused(endpoint, {**MINIMAL[endpoint], name: 1})
        assert (error.param, error.code) == (name, "unsupported_parameter")
        assert "not supported" in error.message


# ---- requests: refused, each naming its field ----

BAD = [
    # (endpoint, fields merged into the minimal body, param, code)
    ("chat", {"foo": 1}, "foo", "unknown_parameter"),
    ("chat", {"guided_json": SCHEMA}, "guided_json", "unsupported_parameter"),
    ("chat", {"response_format": {"type": "json_object", "strict": True}}, "response_format.strict",
     "unknown_parameter"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                         "guided": 1}}},
     "response_format.json_schema.guided", "unknown_parameter"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk",
     "unknown_parameter"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "x": 1}}},
     "text.format.x", "unknown_parameter"),
    ("chat", {"response_format": {"type": "json_object"}, "x-dendrite-schema-options": {"strictest": True}},
     "x-dendrite-schema-options.strictest", "unknown_parameter"),
    ("chat", {"response_format": {"type": "json_object"}, "x-dendrite-schema-options": {"lenient": 1}},
     "x-dendrite-schema-options.lenient", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra", "unknown_parameter"),
    ("chat", {"n": "2"}, "n", "invalid_type"),
    ("chat", {"n": 2.0}, "n", "invalid_type"),
    ("chat", {"temperature": "hot"}, "temperature", "invalid_type"),
    ("chat", {"stream": "yes"}, "stream", "invalid_type"),
    ("chat", {"logprobs": 1}, "logprobs", "invalid_type"),
    ("chat", {"model": 3}, "model", "invalid_type"),
    ("chat", {"messages": "Hi"}, "messages", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
    ("chat", {"temperature": 2.5}, "temperature", "invalid_value"),
    ("chat", {"temperature": -0.1}, "temperature", "invalid_value"),
    ("chat", {"top_p": 0}, "top_p", "invalid_value"),
    ("chat", {"top_p": 1.5}, "top_p", "invalid_value"),
    ("chat", {"min_p": 1.5}, "min_p", "invalid_value"),
    ("completions", {"min_p": -0.1}, "min_p", "invalid_value"),
    ("chat", {"n": 0}, "n", "invalid_value"),
    ("chat", {"n": wire.MAX_CHOICES + 1}, "n", "invalid_value"),
    ("chat", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
    ("chat", {"seed": 2**64}, "seed", "invalid_value"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ("chat", {"stop": ""}, "stop", "invalid_value"),
    ("chat", {"stop": ["a", ""]}, "stop[1]", "invalid_value"),
    ("chat", {"stop": 3}, "stop", "invalid_type"),
    ("chat", {"messages": []}, "messages", "invalid_value"),
    ("chat", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0]", "unsupported_content"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ("chat", {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls", "unsupported_parameter"),
    ("chat", {"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ("chat", {"frequency_penalty": -1}, "frequency_penalty", "unsupported_parameter"),
    ("chat", {"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_parameter"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("chat", {"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "invalid_value"),
    ("chat", {"x-dendrite-schema-options": {"lenient": True}}, "x-dendrite-schema-options", "invalid_value"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "missing_required_parameter"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", "missing_required_parameter"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", "invalid_value"),
    ("chat", {"response_format": {"type": "text", "json_schema": {"name": "p", "schema": SCHEMA}}},
     "response_format.json_schema", "invalid_value"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}}}},
     "response_format.json_schema.schema", "invalid_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema", "invalid_schema"),
    ("completions", {"prompt": []}, "prompt", "invalid_type"),
    ("completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("completions", {"prompt": ["a", ""]}, "prompt[1]", "invalid_value"),
    ("completions", {"prompt": [1, -1]}, "prompt[1]", "invalid_value"),
    ("completions", {"prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
    ("completions", {"prompt": [[1], []]}, "prompt[1]", "invalid_value"),
    ("completions", {"prompt": {"text": "x"}}, "prompt", "invalid_type"),
    ("completions", {"prompt": [True]}, "prompt", "invalid_type"),
    ("completions", {"prompt": ["a"] * (wire.MAX_CHOICES + 1)}, "prompt", "invalid_value"),
    ("completions", {"prompt": ["a", "b", "c"], "n": 50}, "n", "invalid_value"),
    ("completions", {"logprobs": 6}, "logprobs", "invalid_value"),
    ("completions", {"logprobs": True}, "logprobs", "invalid_type"),
    ("completions", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("completions", {"echo": "yes"}, "echo", "invalid_type"),
    ("completions", {"x-dendrite-parent": 5}, "x-dendrite-parent", "invalid_type"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format", "unknown_parameter"),
    ("completions", {"best_of": 3}, "best_of", "unsupported_parameter"),
    ("responses", {"input": []}, "input", "invalid_value"),
    ("responses", {"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]", "unsupported_content"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]", "unsupported_content"),
    ("responses", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ("responses", {"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ("responses", {"previous_response_id": 7}, "previous_response_id", "invalid_type"),
    ("responses", {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name",
     "missing_required_parameter"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema",
     "missing_required_parameter"),
    ("responses", {"text": {"format": {"type": "text", "schema": SCHEMA}}}, "text.format.schema", "invalid_value"),
    ("responses", {"text": {"format": {"type": "json_object", "name": "p"}}}, "text.format.name", "invalid_value"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "nothing"}}}},
     "text.format.schema", "invalid_schema"),
    ("responses", {"text": {"verbosity": "low"}}, "text.verbosity", "unknown_parameter"),
    ("responses", {"temperature": float("nan")}, "temperature", "invalid_value"),
    ("responses", {"n": 2}, "n", "unknown_parameter"),
]


@pytest.mark.parametrize("endpoint, fields, param, code", BAD,
                         ids=[f"{endpoint}-{param}-{code}" for endpoint, _, param, code in BAD])
def test_bad_request_is_a_400_naming_the_field(endpoint, fields, param, code):
    error = refused(endpoint, {**MINIMAL[endpoint], **fields})
    assert (error.param, error.code) == (param, code), error.message
    assert param in error.message


@pytest.mark.parametrize("endpoint", PARSERS)
@pytest.mark.parametrize("missing", ["model", "input-or-messages-or-prompt"])
def test_required_fields(endpoint, missing):
    field = missing if missing == "model" else {"completions": "prompt", "chat": "messages",
                                                "responses": "input"}[endpoint]
    body = {key: value for key, value in MINIMAL[endpoint].items() if key != field}
    error = refused(endpoint, body)
    assert (error.param, error.code) == (field, "missing_required_parameter")


def test_a_body_that_is_not_an_object():
    error = refused("chat", [MINIMAL["chat"]])
    assert error.param is None and "JSON object" in error.message
    with pytest.raises(APIError) as caught:
        read_json(b'{"model": ')
    assert caught.value.status == 400 and caught.value.code == "invalid_json"
    assert read_json(json.dumps(MINIMAL["chat"]).encode()) == MINIMAL["chat"]


# ---- responses: bodies validated as the SDK's types ----

HELLO = (TokenLogprob("Hel", -0.1, top=(TokenLogprob("Hel", -0.1), TokenLogprob("Hi", -2.5))),
         TokenLogprob("lo", -0.2, top=(TokenLogprob("lo", -0.2),)),
         # half of a UTF-8 character, then a token a constraint refused (-inf): JSON cannot hold -inf
         TokenLogprob("\ufffd", -1.0, token_bytes=b"\xe2\x82"),
         TokenLogprob("!", float("-inf")))
USAGE = Usage(prompt_tokens=12, completion_tokens=4, cached_tokens=8)


@pytest.mark.parametrize("engine, openai", [("eos", "stop"), ("stop_string", "stop"), ("grammar_complete", "stop"),
                                            ("max_tokens", "length")])
def test_finish_reasons(engine, openai):
    assert finish_reason(engine) == openai


def test_unknown_finish_reason_is_an_error():
    with pytest.raises(ValueError, match="eos"):
        finish_reason("tired")


def test_chat_completion_body():
    body = chat_completion_body(completion_id="chatcmpl-1", model="m", created=1700000000, usage=USAGE, choices=[
        ChoiceResult("Hello", "eos", HELLO), ChoiceResult("Hel", "max_tokens", None)])
    parsed = exact(ChatCompletion, body)
    assert [c.message.content for c in parsed.choices] == ["Hello", "Hel"] and parsed.choices[1].index == 1
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"] and parsed.choices[1].logprobs is None
    content = parsed.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hel", "lo", "\ufffd", "!"] and content[2].bytes == [0xE2, 0x82]
    assert content[0].bytes == list(b"Hel") and content[3].logprob == -9999.0
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hel", -0.1), ("Hi", -2.5)]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8 and parsed.usage.total_tokens == 16
    json.dumps(body, allow_nan=False)


def test_completion_body_with_echo_logprobs():
    echoed = (TokenLogprob("Say", None), TokenLogprob(" hi", -3.0, top=(TokenLogprob(" hello", -1.0),))) + HELLO
    body = completion_body(completion_id="cmpl-1", model="m", created=1, usage=USAGE,
                           choices=[ChoiceResult("Say hiHello", "stop_string", echoed)])
    logprobs = body["choices"][0]["logprobs"]
    # OpenAI sends null for an echoed prompt's first token, which nothing predicts; the SDK's type has no null
    # there, but the SDK does not validate what it receives (test_protocol_sdk.py gets the null through it).
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    parsed = exact(Completion, body)
    logprobs = parsed.choices[0].logprobs
    assert logprobs.tokens == ["Say", " hi", "Hel", "lo", "\ufffd", "!"]
    assert logprobs.token_logprobs[1:] == [-3.0, -0.1, -0.2, -1.0, -9999.0]
    assert logprobs.top_logprobs[1:3] == [{" hello": -1.0}, {"Hel": -0.1, "Hi": -2.5}]
    assert logprobs.text_offset == [0, 3, 6, 9, 11, 12]
    assert parsed.choices[0].finish_reason == "stop"


def test_chat_chunks_accumulate_in_the_sdk():
    chunks = ChatChunks("chatcmpl-2", "m", 5)
    sent = [chunks.role(0), chunks.content(0, "Hel", HELLO[:1]), chunks.content(0, "lo!", HELLO[1:]),
            chunks.finish(0, "eos"), chunks.usage(USAGE)]
    state = ChatCompletionStreamState()
    for chunk in sent:
        state.handle_chunk(exact(ChatCompletionChunk, chunk))
    final = state.get_final_completion()
    assert final.choices[0].message.content == "Hello!" and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.role == "assistant" and len(final.choices[0].logprobs.content) == 4
    assert sent[-1]["choices"] == [] and final.usage.prompt_tokens_details.cached_tokens == 8


def test_completion_chunks_offsets_run_on():
    chunks = CompletionChunks("cmpl-2", "m", 5)
    first, last = chunks.text(0, "Hello", HELLO[:2]), chunks.text(0, "\ufffd!", HELLO[2:], reason="max_tokens")
    chunks.text(1, "x", HELLO[:1])
    whole = completion_body(completion_id="cmpl-2", model="m", created=5, usage=USAGE,
                            choices=[ChoiceResult("Hello\ufffd!", "max_tokens", HELLO)])
    streamed = first["choices"][0]["logprobs"]["text_offset"] + last["choices"][0]["logprobs"]["text_offset"]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"]
    assert exact(Completion, last).choices[0].finish_reason == "length" and first["choices"][0]["finish_reason"] is None
    assert exact(Completion, chunks.usage(USAGE)).usage.total_tokens == 16


def responses_request(**fields):
    return parse_responses_request({"model": "m", "input": "Hi", **fields})


def test_response_body():
    request = responses_request(instructions="Be brief.", previous_response_id="resp_0", max_output_tokens=50,
                                temperature=0.2, text={"format": {"type": "json_schema", "name": "p",
                                                                  "schema": SCHEMA}})
    body = response_body(request, response_id="resp_1", model="m", created_at=9, message_id="msg_1",
                         text='{"name":"A","age":3}', reason="grammar_complete", usage=USAGE)
    parsed = exact(Response, body)
    assert parsed.status == "completed" and parsed.output_text == '{"name":"A","age":3}'
    assert parsed.output[0].id == "msg_1" and parsed.previous_response_id == "resp_0"
    assert parsed.usage.input_tokens_details.cached_tokens == 8 and parsed.usage.total_tokens == 16
    assert parsed.text.format.type == "json_schema" and parsed.text.format.schema_ == SCHEMA
    assert (parsed.instructions, parsed.max_output_tokens, parsed.temperature) == ("Be brief.", 50, 0.2)
    truncated = exact(Response, response_body(request, response_id="resp_2", model="m", created_at=9,
                                              message_id="msg_2", text="{", reason="max_tokens", usage=USAGE))
    assert truncated.status == "incomplete" and truncated.incomplete_details.reason == "max_output_tokens"
    assert truncated.output[0].status == "incomplete"


@pytest.fixture(scope="module")
def stream_event():
    """The SDK's union of Responses stream events (a few hundred types: seconds to build, so built once)."""
    return pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize("reason, last", [("eos", "response.completed"), ("max_tokens", "response.incomplete")])
def test_response_events_accumulate_in_the_sdk(stream_event, reason, last):
    events = ResponseEvents(responses_request(), response_id="resp_3", model="m", created_at=9, message_id="msg_3")
    sent = events.start() + [events.delta("Hel"), events.delta("lo")] + events.finish(reason, USAGE)
    adapter = stream_event
    state, handled = ResponseStreamState(input_tools=omit, text_format=omit), []   # what responses.stream() runs
    for number, (event_type, payload) in enumerate(sent):
        assert payload["type"] == event_type and payload["sequence_number"] == number
        event = adapter.validate_python(payload)
        exact(type(event), payload)
        handled += state.handle_event(event)
    assert [event_type for event_type, _ in sent] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", last]
    assert Response.model_validate(sent[-1][1]["response"]).output_text == "Hello" and sent[6][1]["text"] == "Hello"
    assert handled[-1].type == last and handled[-1].response.output_text == "Hello"


def test_response_error_event(stream_event):
    events = ResponseEvents(responses_request(), response_id="resp_4", model="m", created_at=9, message_id="msg_4")
    started = events.start()
    event_type, payload = events.error(APIError("the engine stopped", code="engine_error", status=500))
    event = stream_event.validate_python(payload)
    exact(type(event), payload)
    assert (event_type, event.type, event.message, event.code) == ("error", "error", "the engine stopped",
                                                                    "engine_error")
    assert event.sequence_number == len(started)


def test_sse_framing():
    chunk = ChatChunks("c", "m", 1).role(0)
    framed = sse_data(chunk)
    assert framed.startswith("data: ") and framed.endswith("\n\n") and "\n" not in framed[:-2]
    assert json.loads(framed[len("data: "):]) == chunk and SSE_DONE == "data: [DONE]\n\n"
    assert sse_event("response.created", {"type": "response.created"}) == \
        'event: response.created\ndata: {"type":"response.created"}\n\n'
    error = APIError("the engine stopped", code="engine_error", status=500, error_type="server_error")
    assert json.loads(sse_error(error)[len("data: "):]) == error.body()
    with pytest.raises(ValueError):
        sse_data({"logprob": float("-inf")})
