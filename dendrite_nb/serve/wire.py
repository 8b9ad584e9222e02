"""The OpenAI request bodies as pydantic models: every field this server takes, its type and its range.

Unknown fields are refused, never dropped: vLLM's silent drop of `guided_json` made constraints fail open. Some
OpenAI fields are accepted with no effect here (ACCEPTED_WITHOUT_EFFECT says which and why); some are refused
unless they hold their neutral value (0 penalties, no tools), and NOT_SUPPORTED names the OpenAI and vLLM fields
that are refused whatever they hold, so that the error says "not supported" rather than "unknown".
`validate_body` turns pydantic's first complaint into an APIError whose `param` names the field at fault.
Rules that join two fields (top_logprobs needs logprobs, ...) live in protocol_requests.py.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationError)
from pydantic_core import PydanticCustomError

from .errors import APIError

MAX_CHOICES = 128       # n (times the number of prompts, for completions): the branches one request may fork
MAX_STOP_STRINGS = 4    # as OpenAI
MAX_COMPLETION_LOGPROBS = 5   # the legacy completions API's `logprobs` (top alternatives per token)
MAX_CHAT_TOP_LOGPROBS = 20

# Accepted, and no effect on what this server does. OpenAI SDKs and agent frameworks send some of these by default.
ACCEPTED_WITHOUT_EFFECT = {
    "user": "an end-user id for abuse monitoring; nothing here monitors",
    "metadata": "tags for OpenAI's dashboard; there is none here",
    "store": "passed on as ResponsesRequest.store; which responses stay to be continued is the server's "
             "retention policy",
    "parallel_tool_calls": "tool calling is not supported, so there is nothing to parallelise",
    "prompt_cache_key": "prefix reuse here is automatic, for every request",
    "safety_identifier": "as user",
    "include_obfuscation": "(in stream_options) no chunk carries obfuscation padding",
    "name": "(in a chat message) a participant's name; chat templates do not write it",
    "tool_call_id": "(in a tool message) which call it answers; tool calls are not supported",
    "strict": "(in a JSON schema format) the schema is always enforced, strictly, whatever it says",
    "description": "(in a JSON schema format) a note for the model; the schema alone constrains the output",
}

_USE_RESPONSE_FORMAT = "give the JSON schema as response_format {\"type\": \"json_schema\", ...} instead"
NOT_SUPPORTED = {
    "functions": "tool calling is not supported", "function_call": "tool calling is not supported",
    "audio": "only text is supported", "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "this model does not reason",
    "reasoning": "this model does not reason", "web_search_options": "there is no web search",
    "service_tier": "there is one tier", "verbosity": "not supported", "include": "not supported",
    "truncation": "not supported: a request longer than the context is refused with the numbers",
    "background": "not supported", "conversation": "use previous_response_id to continue a response",
    "top_logprobs": "logprobs come from /v1/chat/completions (logprobs, top_logprobs) and /v1/completions (logprobs)",
    "max_tool_calls": "tool calling is not supported", "prompt": "prompt templates are not supported",
    "stream_options": "only /v1/chat/completions and /v1/completions take it",
    "best_of": "not supported; ask for n choices and rank them yourself",
    "suffix": "insertion (suffix) is not supported",
    # vLLM's extensions, which clients send through extra_body
    "guided_json": _USE_RESPONSE_FORMAT, "guided_regex": "not supported", "guided_choice": "not supported",
    "guided_grammar": "not supported", "guided_decoding_backend": "not supported",
    "top_k": "not supported", "repetition_penalty": "not supported",
    "chat_template_kwargs": "not supported",
}

# A union member's Tag ends up in an error's location; tags in angle brackets are dropped from `param`.
_TAG = "<{}>"
_OWN_CODES = ("unsupported_parameter", "unsupported_content")


class _Body(BaseModel):
    # strict: 1.0 is not an int and "1" not a number; an int is accepted where a number is.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _neutral(*allowed: Any):
    """A validator that refuses anything but the field's neutral values: the feature is not supported, and a
    client that sends the default has not asked for it."""
    def check(value: Any) -> Any:
        if value not in allowed:
            shown = " or ".join(json.dumps(v) for v in allowed)
            raise PydanticCustomError("unsupported_parameter",
                                      "not supported by this server; leave it out or send {shown}",
                                      {"shown": shown})
        return value
    return AfterValidator(check)


def _union(choose, expected: str, **members):
    """A union whose member is chosen from the value's shape by `choose` (which returns a member's name, or None
    for a value that fits none: an error that it should be `expected`), so that an error names one member's
    problem rather than one per member."""
    def discriminate(value: Any) -> str | None:
        name = choose(value)
        return None if name is None else _TAG.format(name)
    options = tuple(Annotated[kind, Tag(_TAG.format(name))] for name, kind in members.items())
    return Annotated[Union[options], Discriminator(discriminate, custom_error_type="invalid_type",
                                                   custom_error_message=f"Input should be {expected}")]


Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
MinP = Annotated[float, Field(ge=0, le=1)]  # vLLM's extension (extra_body): tokens under min_p x the best's are cut
MaxTokens = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=-2**63, lt=2**64)]
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, _neutral(0)]
LogitBias = Annotated[dict[str, float] | None, _neutral(None, {})]
Tools = Annotated[list[Any] | None, _neutral(None, [])]
ToolChoice = Annotated[Any, _neutral(None, "none")]


def _stop_kind(value: Any) -> str | None:
    return "one" if isinstance(value, str) else "list" if isinstance(value, list) else None


Stop = _union(_stop_kind, one=Annotated[str, Field(min_length=1)],
              list=Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)],
              expected=f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list) or not value:
        return None
    first = value[0]
    return ("texts" if isinstance(first, str) else "ids" if isinstance(first, int) and not isinstance(first, bool)
            else "id_lists" if isinstance(first, list) else None)


Prompt = _union(_prompt_kind, text=str, texts=list[str], ids=list[TokenId],
                id_lists=list[Annotated[list[TokenId], Field(min_length=1)]],
                expected="a string, a list of strings, a list of token ids, or a list of lists of token ids")


def _only(kinds: tuple[str, ...], what: str, default: str | None = None):
    """Parts or items of another type get an error that says what this server supports, rather than
    pydantic's complaint about their fields. `default`: the type of one that names none."""
    def check(value: Any) -> Any:
        if isinstance(value, dict) and value.get("type", default) not in kinds:
            raise PydanticCustomError("unsupported_content", "this server supports only {what}, got type {got}",
                                      {"what": what, "got": json.dumps(value.get("type"))})
        return value
    return BeforeValidator(check)


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool = True


class ChatTextPart(_Body):
    type: Literal["text"]
    text: str


def _content_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


ChatPart = Annotated[ChatTextPart, _only(("text",), 'text parts {"type": "text", "text": ...}')]
ChatContent = _union(_content_kind, text=str, parts=list[ChatPart],
                     expected='a string or a list of {"type": "text", "text": ...} parts')


class ChatMessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ChatContent
    name: str | None = None
    tool_call_id: str | None = None
    # what an SDK's own message object holds when a client sends a reply back as it got it
    refusal: Annotated[Any, _neutral(None)] = None
    tool_calls: Tools = None
    function_call: Annotated[Any, _neutral(None)] = None
    audio: Annotated[Any, _neutral(None)] = None
    annotations: Annotated[Any, _neutral(None, [])] = None


class JSONSchemaFormat(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SchemaOptions(_Body):
    """x-dendrite-schema-options: llguidance's JSON-schema compiler options (see dendrite_nb.constraints)."""
    lenient: bool | None = None
    coerce_one_of: bool | None = None


class _Sampled(_Body):
    model: Annotated[str, Field(min_length=1)]
    temperature: Temperature | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stream: bool = False
    user: str | None = None


class _Choices(_Sampled):
    n: Choices = 1
    stop: Stop | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0
    frequency_penalty: Penalty = 0
    logit_bias: LogitBias = None
    parent: str | None = Field(None, alias="x-dendrite-parent")


class CompletionBody(_Choices):
    prompt: Prompt
    max_tokens: MaxTokens | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False


class _Agentic(_Body):
    metadata: dict[str, str] | None = None
    store: bool = True
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    tools: Tools = None
    tool_choice: ToolChoice = None


class ChatBody(_Choices, _Agentic):
    messages: Annotated[list[ChatMessageBody], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    schema_options: SchemaOptions | None = Field(None, alias="x-dendrite-schema-options")


class InputTextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None   # on output_text parts sent back as they came: no effect
    logprobs: list[Any] | None = None


InputPart = Annotated[InputTextPart, _only(("input_text", "output_text"),
                                          'text parts {"type": "input_text", "text": ...}')]
InputContent = _union(_content_kind, text=str, parts=list[InputPart],
                      expected='a string or a list of {"type": "input_text", "text": ...} parts')


class InputMessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: InputContent
    type: Literal["message"] = "message"
    id: str | None = None        # an output message sent back as it came: no effect
    status: str | None = None


def _input_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "items" if isinstance(value, list) else None


InputItem = Annotated[InputMessageBody, _only(("message",), 'message items {"role": ..., "content": ...}', "message")]
ResponsesInput = _union(_input_kind, text=Annotated[str, Field(min_length=1)],
                        items=Annotated[list[InputItem], Field(min_length=1)],
                        expected='a string or a list of message items {"role": ..., "content": ...}')


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesBody(_Sampled, _Agentic):
    input: ResponsesInput
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    max_output_tokens: MaxTokens | None = None
    text: TextConfig | None = None


Body = TypeVar("Body", bound=_Body)


def validate_body(model: type[Body], body: Any) -> Body:
    """The body as `model`, or an APIError (400) about the first thing wrong in it."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}.", code="invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _api_error(error.errors()[0]) from None


def param_name(location: tuple[str | int, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content", with union tags left out."""
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not (part.startswith("<") and part.endswith(">")):
            text += f".{part}" if text else part
    return text


def _shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


def _api_error(detail: dict[str, Any]) -> APIError:
    kind, param = detail["type"], param_name(detail["loc"])
    if kind == "extra_forbidden":
        field = str(detail["loc"][-1])
        if len(detail["loc"]) == 1 and field in NOT_SUPPORTED:
            return APIError(f"{param} is not supported by this server ({NOT_SUPPORTED[field]}); remove it.",
                            param=param, code="unsupported_parameter")
        return APIError(f"unknown field {param!r}: this server does not know it, and it refuses what it does not "
                        f"know rather than ignore it; remove it, or check its spelling.", param=param,
                        code="unknown_parameter")
    if kind == "missing":
        return APIError(f"{param} is required.", param=param, code="missing_required_parameter")
    message, got = detail["msg"], f", got {_shown(detail['input'])}"
    if kind in _OWN_CODES:   # our validators' messages, written to follow the field's name
        return APIError(f"{param}: {message}.", param=param, code=kind)
    if kind == "model_type":    # pydantic names the model class, which means nothing to a client
        message = "should be a JSON object"
    elif message.startswith("Input should"):
        message = message.replace("Input should", "should", 1)
    else:
        message = f"is invalid: {message[0].lower()}{message[1:]}".replace(" after validation", "")
    return APIError(f"{param} {message}{got}.", param=param,
                    code="invalid_type" if kind.endswith("_type") else "invalid_value")
