"""OpenAI request bodies in, frozen requests out: what the engine needs to run each one, or an APIError (400).

    parse_completion_request(body) -> CompletionRequest     POST /v1/completions
    parse_chat_request(body)       -> ChatRequest           POST /v1/chat/completions
    parse_responses_request(body)  -> ResponsesRequest      POST /v1/responses

Each request carries the engine's SamplingParams, its max_new_tokens and, for a structured output, the constraint
spec that Engine.generate takes; a schema is checked here with parse_constraint, so a bad one is a 400 with
llguidance's own message before anything runs. wire.py holds the fields, their types and ranges; this file holds
the rules that join two fields and the translation. Parsing changes nothing anywhere.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from ..constraints import parse_constraint
from ..errors import ConstraintError
from ..sampling import SamplingParams
from . import wire
from .errors import APIError

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat and responses have none
JSON_OBJECT_SCHEMA = {"type": "object"}
ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system role, which chat templates do not know
PART_SEPARATOR = "\n"   # between the text parts of one message's content, as vLLM joins them


class Message(NamedTuple):
    role: str      # "system", "user", "assistant" or "tool" ("developer" arrives as "system")
    content: str   # the message's text parts, joined by PART_SEPARATOR


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]   # text or token ids; each prompt gets n choices
    n: int
    max_new_tokens: int
    sampling: SamplingParams
    logprobs: int | None      # None: none; k: each token's log-prob and its k likeliest alternatives
    echo: bool                # the prompt comes back in front of the choice's text (and in its logprobs)
    stream: bool
    include_usage: bool       # streamed: a last chunk with the usage
    parent: str | None        # x-dendrite-parent: the response id (a node of the tree) the prompts continue

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    n: int
    max_new_tokens: int | None    # None: until EOS, a stop string, a complete grammar or the end of the context
    sampling: SamplingParams
    logprobs: bool
    top_logprobs: int             # alternatives per token (0 to 20) when logprobs
    stream: bool
    include_usage: bool
    constraint_spec: dict[str, Any] | None   # for Engine.generate(constraint=...); None: free text
    parent: str | None            # x-dendrite-parent: the response id (a node of the tree) the messages continue


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    instructions: str | None       # a system message before the input; not carried on to the next response
    messages: tuple[Message, ...]  # the input
    previous_response_id: str | None
    max_new_tokens: int | None     # max_output_tokens; None: until EOS, a complete grammar or the end of context
    sampling: SamplingParams
    stream: bool
    constraint_spec: dict[str, Any] | None
    text_format: dict[str, Any]    # the text.format to echo in the response object ({"type": "text"} by default)
    store: bool                    # accepted either way: see wire.ACCEPTED_WITHOUT_EFFECT


def read_json(raw: bytes) -> Any:
    """A request body's bytes as JSON, or an APIError (400)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:   # UnicodeDecodeError is a ValueError
        raise APIError(f"the request body is not valid JSON ({error}); send a JSON object.",
                       code="invalid_json") from None


def parse_completion_request(body: Any) -> CompletionRequest:
    wire_body = wire.validate_body(wire.CompletionBody, body)
    prompts = _prompts(wire_body.prompt)
    if wire_body.n * len(prompts) > wire.MAX_CHOICES:
        raise APIError(f"n={wire_body.n} for each of {len(prompts)} prompts asks for {wire_body.n * len(prompts)} "
                       f"choices; one request may ask for at most {wire.MAX_CHOICES}. Split the prompts over "
                       f"several requests.", param="n", code="invalid_value")
    _check_stream_options(wire_body)
    return CompletionRequest(
        model=wire_body.model, prompts=prompts, n=wire_body.n,
        max_new_tokens=wire_body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, sampling=_sampling(wire_body),
        logprobs=wire_body.logprobs, echo=wire_body.echo, stream=wire_body.stream,
        include_usage=_include_usage(wire_body), parent=wire_body.parent)


def parse_chat_request(body: Any, check: Callable[[dict[str, Any]], Any] = parse_constraint) -> ChatRequest:
    """check: how a structured output's spec is checked (the server passes Engine.parse_constraint, which compiles
    it once under the model's tokenizer for the generation to reuse)."""
    wire_body = wire.validate_body(wire.ChatBody, body)
    budgets = (wire_body.max_tokens, wire_body.max_completion_tokens)
    if None not in budgets and budgets[0] != budgets[1]:
        raise APIError(f"max_tokens ({budgets[0]}) and max_completion_tokens ({budgets[1]}) disagree; send one of "
                       f"them (max_tokens is the older name).", param="max_completion_tokens", code="invalid_value")
    if wire_body.top_logprobs is not None and not wire_body.logprobs:
        raise APIError("top_logprobs needs logprobs: true; send both, or leave top_logprobs out.",
                       param="top_logprobs", code="invalid_value")
    _check_stream_options(wire_body)
    return ChatRequest(
        model=wire_body.model, messages=tuple(_message(m.role, m.content) for m in wire_body.messages),
        n=wire_body.n, max_new_tokens=wire_body.max_completion_tokens or wire_body.max_tokens,
        sampling=_sampling(wire_body), logprobs=bool(wire_body.logprobs), top_logprobs=wire_body.top_logprobs or 0,
        stream=wire_body.stream, include_usage=_include_usage(wire_body),
        constraint_spec=_chat_constraint(wire_body.response_format, wire_body.schema_options, check),
        parent=wire_body.parent)


def parse_responses_request(body: Any, check: Callable[[dict[str, Any]], Any] = parse_constraint) -> ResponsesRequest:
    """check: as parse_chat_request's."""
    wire_body = wire.validate_body(wire.ResponsesBody, body)
    if isinstance(wire_body.input, str):
        messages = (Message("user", wire_body.input),)
    else:
        messages = tuple(_message(m.role, m.content) for m in wire_body.input)
    text_format = wire_body.text.format if wire_body.text is not None else None
    return ResponsesRequest(
        model=wire_body.model, instructions=wire_body.instructions, messages=messages,
        previous_response_id=wire_body.previous_response_id, max_new_tokens=wire_body.max_output_tokens,
        sampling=_sampling(wire_body), stream=wire_body.stream, constraint_spec=_responses_constraint(text_format, check),
        text_format=(text_format.model_dump(by_alias=True, exclude_none=True) if text_format is not None
                     else {"type": "text"}),
        store=wire_body.store)


def _prompts(prompt: str | list) -> tuple[str | tuple[int, ...], ...]:
    """The four shapes of `prompt` as one tuple of prompts (the wire model has checked each shape)."""
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt[0], int):
        prompts = (tuple(prompt),)
    else:
        prompts = tuple(p if isinstance(p, str) else tuple(p) for p in prompt)
    for index, text in enumerate(prompts):
        if isinstance(text, str) and not text:
            param = "prompt" if isinstance(prompt, str) else f"prompt[{index}]"
            raise APIError(f"{param} is empty; give it some text or token ids to continue.", param=param,
                           code="invalid_value")
    if len(prompts) > wire.MAX_CHOICES:
        raise APIError(f"prompt holds {len(prompts)} prompts; one request may hold at most {wire.MAX_CHOICES}. "
                       f"Split them over several requests.", param="prompt", code="invalid_value")
    return prompts


def _message(role: str, content: str | list) -> Message:
    text = content if isinstance(content, str) else PART_SEPARATOR.join(part.text for part in content)
    return Message(ROLE_ALIASES.get(role, role), text)


def _sampling(body: Any) -> SamplingParams:
    stop = getattr(body, "stop", None)
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p,
                          min_p=0.0 if body.min_p is None else body.min_p,
                          stop=() if stop is None else stop, seed=body.seed)


def _check_stream_options(body: Any) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options applies only to a streamed request; send stream: true, or leave "
                       "stream_options out.", param="stream_options", code="invalid_value")


def _include_usage(body: Any) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _chat_constraint(response_format: wire.ResponseFormat | None, options: wire.SchemaOptions | None,
                     check: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
    kind = "text" if response_format is None else response_format.type
    if response_format is not None and kind != "json_schema" and response_format.json_schema is not None:
        raise APIError(f"response_format.json_schema goes only with type \"json_schema\", and the type is {kind!r}.",
                       param="response_format.json_schema", code="invalid_value")
    if kind == "json_schema" and response_format.json_schema is None:
        raise APIError('response_format.json_schema is required with type "json_schema": give '
                       '{"name": ..., "schema": {...}}.',
                       param="response_format.json_schema", code="missing_required_parameter")
    if kind == "text":
        if options is not None:
            raise APIError("x-dendrite-schema-options applies to a JSON response_format (json_schema or "
                           "json_object); leave it out for free text.", param="x-dendrite-schema-options",
                           code="invalid_value")
        return None
    schema = JSON_OBJECT_SCHEMA if kind == "json_object" else response_format.json_schema.schema_
    return _checked_spec(schema, options, "response_format.json_schema.schema", check)


def _responses_constraint(text_format: wire.TextFormat | None,
                          check: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
    if text_format is None or text_format.type == "text":
        extra = text_format is not None and _json_schema_fields(text_format)
        if extra:
            raise APIError(f"text.format.{extra[0]} goes only with type \"json_schema\".",
                           param=f"text.format.{extra[0]}", code="invalid_value")
        return None
    if text_format.type == "json_object":
        extra = _json_schema_fields(text_format)
        if extra:
            raise APIError(f"text.format.{extra[0]} goes only with type \"json_schema\", and the type is "
                           f"\"json_object\".", param=f"text.format.{extra[0]}", code="invalid_value")
        return _checked_spec(JSON_OBJECT_SCHEMA, None, "text.format", check)
    for field, value in (("name", text_format.name), ("schema", text_format.schema_)):
        if value is None:
            raise APIError(f'text.format.{field} is required with type "json_schema".', param=f"text.format.{field}",
                           code="missing_required_parameter")
    return _checked_spec(text_format.schema_, None, "text.format.schema", check)


def _json_schema_fields(text_format: wire.TextFormat) -> list[str]:
    return [name for name, value in (("name", text_format.name), ("schema", text_format.schema_),
                                     ("strict", text_format.strict), ("description", text_format.description))
            if value is not None]


def _checked_spec(schema: dict[str, Any], options: wire.SchemaOptions | None, param: str,
                  check: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """The constraint spec for Engine.generate, checked by the engine's own parse_constraint (llguidance
    compiles it), so that a schema the engine cannot enforce is a 400 now rather than a failure mid-stream."""
    spec: dict[str, Any] = {"json_schema": schema}
    if options is not None:
        spec.update(options.model_dump(exclude_none=True))
    try:
        check(spec)
    except ConstraintError as error:
        raise APIError(f"{param}: {error}", param=param, code="invalid_schema") from None
    return spec
