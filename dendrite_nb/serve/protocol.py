"""The OpenAI wire protocol, with no engine and no HTTP framework in it: the one place the server imports it from.

    wire.py                the request bodies' fields, types and ranges (pydantic), and which fields are
                           accepted without effect or refused as not supported
    protocol_requests.py   body -> CompletionRequest / ChatRequest / ResponsesRequest, or an APIError (400)
    protocol_responses.py  chat.completion, text_completion and response objects, logprobs, usage, finish reasons
    protocol_streams.py    their streamed chunks and events, and the server-sent-event framing
    errors.py              APIError: the status and the OpenAI-style error body
"""
from .errors import APIError
from .protocol_requests import (ChatRequest, CompletionRequest, Message, ResponsesRequest, parse_chat_request,
                                parse_completion_request, parse_responses_request, read_json)
from .protocol_responses import (FINISH_REASONS, ChoiceResult, TokenLogprob, Usage, chat_completion_body,
                                 completion_body, finish_reason, new_id, response_body, response_in_progress)
from .protocol_streams import (SSE_DONE, ChatChunks, CompletionChunks, ResponseEvents, sse_data, sse_error,
                               sse_event)
from .wire import ACCEPTED_WITHOUT_EFFECT, MAX_CHOICES, NOT_SUPPORTED

__all__ = ["ACCEPTED_WITHOUT_EFFECT", "APIError", "ChatChunks", "ChatRequest", "ChoiceResult", "CompletionChunks",
           "CompletionRequest", "FINISH_REASONS", "MAX_CHOICES", "Message", "NOT_SUPPORTED", "ResponseEvents",
           "ResponsesRequest", "SSE_DONE", "TokenLogprob", "Usage", "chat_completion_body", "completion_body",
           "finish_reason", "new_id", "parse_chat_request", "parse_completion_request", "parse_responses_request",
           "read_json", "response_body", "response_in_progress", "sse_data", "sse_error", "sse_event"]
