"""Response bodies in OpenAI's shapes, built from plain values: ids, texts, per-token log-probs, the engine's
finish reasons and token counts. No engine and no HTTP here; the streamed forms are in protocol_streams.py.

    chat_completion_body(...)   a chat.completion
    completion_body(...)        a text_completion
    response_body(...)          a finished Responses API response object (response_in_progress: a started one)
    finish_reason(reason)       the engine's stop reason as OpenAI's finish_reason
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from .protocol_requests import ResponsesRequest

# The engine's reason a branch stopped -> OpenAI's finish_reason. A completed grammar is a natural stop.
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "grammar_complete": "stop", "max_tokens": "length"}
# OpenAI's stand-in for a log-prob too small to be finite (JSON has no -Infinity): a constraint's refused tokens.
LOGPROB_FLOOR = -9999.0


class TokenLogprob(NamedTuple):
    token: str                 # the token's text, decoded alone
    logprob: float | None      # natural log; None only for an echoed prompt's first token, which nothing predicts
    token_bytes: bytes | None = None    # its raw bytes when they differ from token.encode(): a part of a UTF-8
                                        # character, whose text alone is U+FFFD
    top: tuple["TokenLogprob", ...] = ()   # the likeliest tokens at this position, likeliest first


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0     # prompt tokens whose KV the tree already held: reused, not prefilled


class ChoiceResult(NamedTuple):
    text: str                  # for completions with echo, the prompt's text and then the generated text
    finish_reason: str         # the engine's: one of FINISH_REASONS
    logprobs: tuple[TokenLogprob, ...] | None = None   # None: not asked for


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's style: "chatcmpl-", "cmpl-", "resp_", "msg_" followed by 32 hex digits."""
    return f"{prefix}{uuid.uuid4().hex}"


def finish_reason(reason: str) -> str:
    try:
        return FINISH_REASONS[reason]
    except KeyError:
        raise ValueError(f"unknown finish reason {reason!r}; the engine gives one of "
                         f"{', '.join(FINISH_REASONS)}.") from None


def finite_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def usage_body(usage: Usage) -> dict[str, Any]:
    """The usage of chat completions and completions."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def responses_usage_body(usage: Usage) -> dict[str, Any]:
    """The usage of the Responses API. Every prompt token not reused was prefilled into the tree, where the next
    request can reuse it: those are the tokens written to the cache."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def chat_logprobs_body(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...], "refusal": None}."""
    def entry(item: TokenLogprob) -> dict[str, Any]:
        raw = item.token_bytes if item.token_bytes is not None else item.token.encode()
        return {"token": item.token, "logprob": finite_logprob(item.logprob), "bytes": list(raw)}

    return {"content": [{**entry(item), "top_logprobs": [entry(alt) for alt in item.top]} for item in tokens],
            "refusal": None}


def completion_logprobs_body(tokens: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """A completion choice's logprobs in the legacy format. text_offset[i] is where token i starts in the
    choice's text, counted from `text_offset` (where an earlier chunk of a stream left off), as the sum of the
    lengths of the tokens' texts decoded one by one. Two alternatives with the same text share one key of
    top_logprobs, as the format allows no better; an echoed prompt's first token has None for both."""
    offsets, token_logprobs, top_logprobs = [], [], []
    for item in tokens:
        offsets.append(text_offset)
        text_offset += len(item.token)
        if item.logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite_logprob(item.logprob))
        alternatives: dict[str, float] = {}
        for alt in item.top:
            alternatives.setdefault(alt.token, finite_logprob(alt.logprob))
        top_logprobs.append(alternatives)
    return {"tokens": [item.token for item in tokens], "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_completion_body(*, completion_id: str, model: str, created: int, choices: Sequence[ChoiceResult],
                         usage: Usage) -> dict[str, Any]:
    """A chat.completion; choices are numbered in the order given."""
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": index, "message": {"role": "assistant", "content": choice.text},
                         "logprobs": None if choice.logprobs is None else chat_logprobs_body(choice.logprobs),
                         "finish_reason": finish_reason(choice.finish_reason)}
                        for index, choice in enumerate(choices)],
            "usage": usage_body(usage)}


def completion_body(*, completion_id: str, model: str, created: int, choices: Sequence[ChoiceResult],
                    usage: Usage) -> dict[str, Any]:
    """A text_completion; choices are numbered in the order given (prompt by prompt, n each)."""
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": choice.text,
                         "logprobs": None if choice.logprobs is None else completion_logprobs_body(choice.logprobs),
                         "finish_reason": finish_reason(choice.finish_reason)}
                        for index, choice in enumerate(choices)],
            "usage": usage_body(usage)}


def output_message(message_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A Responses API output message; text None: one whose content part has not started."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": message_id, "role": "assistant", "status": status, "content": content}


def response_in_progress(request: ResponsesRequest, *, response_id: str, model: str,
                         created_at: int) -> dict[str, Any]:
    """A Responses API response object that has started and has no output yet (what a stream opens with)."""
    return _response(request, response_id, model, created_at, "in_progress", output=[], usage=None,
                     incomplete=None)


def response_body(request: ResponsesRequest, *, response_id: str, model: str, created_at: int, message_id: str,
                  text: str, reason: str, usage: Usage) -> dict[str, Any]:
    """A finished Responses API response object: "completed", or "incomplete" when the token budget ran out
    (as OpenAI reports max_output_tokens), its one output message `message_id` holding `text`."""
    truncated = finish_reason(reason) == "length"
    status = "incomplete" if truncated else "completed"
    return _response(request, response_id, model, created_at, status,
                     output=[output_message(message_id, text, status)], usage=responses_usage_body(usage),
                     incomplete={"reason": "max_output_tokens"} if truncated else None)


def _response(request: ResponsesRequest, response_id: str, model: str, created_at: int, status: str, *,
              output: list[dict[str, Any]], usage: dict[str, Any] | None,
              incomplete: dict[str, str] | None) -> dict[str, Any]:
    # No tools here: parallel_tool_calls, tool_choice and tools are required by the SDK's type, and say so.
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status, "model": model,
            "output": output, "usage": usage, "incomplete_details": incomplete, "error": None,
            "instructions": request.instructions, "previous_response_id": request.previous_response_id,
            "max_output_tokens": request.max_new_tokens, "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p, "text": {"format": request.text_format},
            "parallel_tool_calls": False, "tool_choice": "none", "tools": []}
