"""The streamed forms of the three endpoints, built from plain values, and their server-sent-event framing.

    ChatChunks        chat.completion.chunk: a choice's role first, then content deltas, then its finish_reason;
                      with include_usage, a last chunk with no choices and the usage
    CompletionChunks  text_completion chunks, each choice's text_offset running on across its chunks
    ResponseEvents    the Responses API's events, from response.created to response.completed (or .incomplete)
    sse_data / SSE_DONE / sse_event / sse_error   the wire framing
Chat and completions frame each chunk as `data: {json}` and end with `data: [DONE]`; the Responses API frames
each event as `event: <type>` + `data: {json}`, with no [DONE].
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .errors import APIError
from .protocol_requests import ResponsesRequest
from .protocol_responses import (TokenLogprob, Usage, chat_logprobs_body, completion_logprobs_body, finish_reason,
                                 output_message, response_body, response_in_progress, usage_body)

SSE_DONE = "data: [DONE]\n\n"


def _json(payload: dict[str, Any]) -> str:
    # allow_nan=False: NaN or Infinity would be invalid JSON, which a client's parser rejects mid-stream.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse_data(payload: dict[str, Any]) -> str:
    """One chunk of a chat or completions stream."""
    return f"data: {_json(payload)}\n\n"


def sse_event(event_type: str, payload: dict[str, Any]) -> str:
    """One event of a Responses API stream."""
    return f"event: {event_type}\ndata: {_json(payload)}\n\n"


def sse_error(error: APIError) -> str:
    """An error in the middle of a chat or completions stream: the OpenAI SDK raises it as an APIError."""
    return sse_data(error.body())


class ChatChunks:
    """The chunks of one streamed chat completion; all share its id, model and created time."""

    def __init__(self, completion_id: str, model: str, created: int):
        self.completion_id, self.model, self.created = completion_id, model, created

    def role(self, index: int) -> dict[str, Any]:
        """A choice's first chunk: who speaks (as OpenAI sends it, with empty content)."""
        return self._chunk(index, {"role": "assistant", "content": ""})

    def content(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        """More of a choice's text, with the log-probs of the tokens that make it when they were asked for."""
        return self._chunk(index, {"content": text},
                           logprobs=None if logprobs is None else chat_logprobs_body(logprobs))

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        """A choice's last chunk, with the engine's reason it stopped as OpenAI's finish_reason."""
        return self._chunk(index, {}, reason=finish_reason(reason))

    def usage(self, usage: Usage) -> dict[str, Any]:
        """The stream's last chunk with stream_options.include_usage: no choices, the whole request's usage."""
        return {**self._head(), "choices": [], "usage": usage_body(usage)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               reason: str | None = None) -> dict[str, Any]:
        return {**self._head(),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


class CompletionChunks:
    """The chunks of one streamed text completion; all share its id, model and created time. Each choice's
    log-prob text_offset runs on from where its previous chunk's tokens ended, so the offsets are those of the
    unstreamed body."""

    def __init__(self, completion_id: str, model: str, created: int):
        self.completion_id, self.model, self.created = completion_id, model, created
        self._offsets: dict[int, int] = {}   # choice index -> characters of its tokens' texts sent so far

    def text(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None = None,
             reason: str | None = None) -> dict[str, Any]:
        """More of a choice's text (with echo, the prompt's first), and with the engine's `reason` when it is
        the choice's last chunk."""
        body = None
        if logprobs is not None:
            offset = self._offsets.get(index, 0)
            body = completion_logprobs_body(logprobs, offset)
            self._offsets[index] = offset + sum(len(item.token) for item in logprobs)
        return {**self._head(), "choices": [{"index": index, "text": text, "logprobs": body,
                                             "finish_reason": None if reason is None else finish_reason(reason)}]}

    def usage(self, usage: Usage) -> dict[str, Any]:
        """The stream's last chunk with stream_options.include_usage: no choices, the whole request's usage."""
        return {**self._head(), "choices": [], "usage": usage_body(usage)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.completion_id, "object": "text_completion", "created": self.created, "model": self.model}


class ResponseEvents:
    """The events of one streamed Responses API response, as (type, payload) pairs for sse_event, numbered in
    order. One output message, one output_text part: start(), then delta() per piece of text, then finish().
    The message's text is kept here to close the part and the message with."""

    def __init__(self, request: ResponsesRequest, *, response_id: str, model: str, created_at: int,
                 message_id: str):
        self.request, self.response_id, self.model, self.created_at = request, response_id, model, created_at
        self.message_id = message_id
        self.text = ""
        self._sequence_number = 0

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        """response.created, response.in_progress, and the empty message and text part that deltas fill."""
        started = response_in_progress(self.request, response_id=self.response_id, model=self.model,
                                       created_at=self.created_at)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event("response.output_item.added", output_index=0,
                            item=output_message(self.message_id, None, "in_progress")),
                self._event("response.content_part.added", **self._where(), part=self._part())]

    def delta(self, text: str) -> tuple[str, dict[str, Any]]:
        self.text += text
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def finish(self, reason: str, usage: Usage) -> list[tuple[str, dict[str, Any]]]:
        """The text part and the message closed, then response.completed (or response.incomplete when the
        token budget ran out) carrying the whole response."""
        done = response_body(self.request, response_id=self.response_id, model=self.model,
                             created_at=self.created_at, message_id=self.message_id, text=self.text, reason=reason,
                             usage=usage)
        return [self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=self._part()),
                self._event("response.output_item.done", output_index=0, item=done["output"][0]),
                self._event(f"response.{done['status']}", response=done)]

    def error(self, error: APIError) -> tuple[str, dict[str, Any]]:
        """A failure after the stream started (the status line is sent): the Responses API's error event."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def _event(self, event_type: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        payload = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event_type, payload
