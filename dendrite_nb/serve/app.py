"""The HTTP side: a Starlette app whose handlers parse, enqueue a job on the engine thread, and stream what it does.

Handlers never touch the engine's tree: they tokenize (to check the context and size the job) and decode text,
which only read the tokenizer; everything else runs on the scheduler's thread (scheduler.py). A client that hangs
up mid-stream cancels its job, and its branches are freed at the next step boundary.

Routes: GET /v1/models; POST /v1/completions, /v1/chat/completions, /v1/responses; DELETE /v1/responses/{id} and
/v1/chat/completions/{id} (prune a kept response). Tree extensions: every response id names branches of the tree
(`<id>`, or `<id>/<i>` per choice), `x-dendrite-parent` (chat, completions) and `previous_response_id` continue from
one with nothing re-prefilled, and n > 1 is a fork.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import (ChatError, ConstraintError, ContextOverflow, DendriteError, EmptyBranch, OutOfBlocks,
                      UnknownBranch)
from . import protocol
from .jobs import ChoicePlan, PromptPlan, abandon, blocks_for, check_prompt_fits, prepare
from .retention import Retention
from .scheduler import Job, QueueFull, Scheduler, SchedulerStopped, Update
from .text_stream import TextStream


@dataclass
class ServerState:
    """What every handler shares: the engine (read only from here), its thread, and what is kept."""

    engine: Any
    scheduler: Scheduler
    retention: Retention
    model_name: str
    api_key: str | None = None
    requests_served: int = 0


def as_api_error(error: BaseException) -> protocol.APIError:
    """An engine's refusal as the HTTP error a client should see."""
    if isinstance(error, protocol.APIError):
        return error
    if isinstance(error, QueueFull):
        return protocol.APIError(str(error), code="rate_limit_exceeded", status=429, error_type="rate_limit_error")
    if isinstance(error, SchedulerStopped):
        return protocol.APIError(str(error), code="server_shutting_down", status=503, error_type="server_error")
    if isinstance(error, ContextOverflow):
        return protocol.APIError(str(error), code="context_length_exceeded")
    if isinstance(error, UnknownBranch):
        return protocol.APIError(str(error), code="response_not_found", status=404)
    if isinstance(error, OutOfBlocks):
        return protocol.APIError(str(error), code="out_of_kv_blocks", status=503, error_type="server_error")
    if isinstance(error, (ChatError, ConstraintError, EmptyBranch, DendriteError, ValueError, TypeError)):
        return protocol.APIError(str(error), code="invalid_request")
    return protocol.APIError(f"the server failed on this request: {type(error).__name__}: {error}", status=500,
                         code="internal_error", error_type="server_error")


def error_response(error: BaseException) -> JSONResponse:
    api_error = as_api_error(error)
    if api_error.status >= 500:
        traceback.print_exception(error)
    return JSONResponse(api_error.body(), status_code=api_error.status)


class Choice:
    """One choice's text and log-probabilities as its tokens arrive."""

    def __init__(self, engine: Any, stop: tuple[str, ...], logprobs: bool):
        self._engine = engine
        self.stream = TextStream(lambda ids: engine.decode(ids, skip_end_tokens=True), stop)
        self.keep_logprobs = logprobs
        self.logprobs: list[protocol.TokenLogprob] = []
        self.reason: str | None = None

    def token_logprob(self, token: int, logprob: float | None, top: list | None) -> protocol.TokenLogprob:
        decode = self._engine.decode
        alternatives = tuple(protocol.TokenLogprob(decode([t]), lp) for t, lp in (top or []))
        return protocol.TokenLogprob(decode([token]), logprob, None, alternatives)

    def push(self, token: int, logprob: float | None, top: list | None) -> tuple[str, list[protocol.TokenLogprob]]:
        """The text now safe to send, and the new token's log-probability entry (when kept)."""
        delta = self.stream.push(token)
        if not self.keep_logprobs or self.stream.stopped and not delta:
            return delta, []
        entry = self.token_logprob(token, logprob, top)
        self.logprobs.append(entry)
        return delta, [entry]


class RunningJob:
    """A job on the engine thread, seen from the event loop: its updates arrive on an asyncio queue."""

    def __init__(self, state: ServerState, plan: ChoicePlan, blocks_needed: int):
        loop = asyncio.get_running_loop()
        self.state, self.plan = state, plan
        self._updates: asyncio.Queue[Update] = asyncio.Queue()
        retention = state.retention
        self.job = Job(prepare=lambda engine: prepare(engine, retention, plan),
                       sink=lambda update: loop.call_soon_threadsafe(self._updates.put_nowait, update),
                       blocks_needed=blocks_needed, abandon=abandon,
                       complete=lambda engine, prepared: retention.keep(plan.response_id, prepared.info["names"]))
        self.finished = False
        state.scheduler.submit(self.job)

    async def updates(self) -> AsyncIterator[Update]:
        while True:
            update = await self._updates.get()
            if update.kind in ("done", "failed", "cancelled"):
                self.finished = True
            yield update
            if self.finished:
                return

    def cancel(self) -> None:
        if not self.finished:
            self.state.scheduler.cancel(self.job)


def make_app(state: ServerState) -> Starlette:
    """The server's routes over `state` (server.py builds the state and runs the app)."""

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def route(request: Request) -> Response:
            if state.api_key is not None:
                sent = request.headers.get("authorization", "")
                if sent != f"Bearer {state.api_key}":
                    return JSONResponse(protocol.APIError("a valid API key is needed: send 'Authorization: Bearer "
                                                      "<key>' (the key the server was started with).",
                                                      code="invalid_api_key", status=401,
                                                      error_type="authentication_error").body(), status_code=401)
            try:
                return await handler(request)
            except Exception as error:   # anything a request raised before its stream started
                return error_response(error)
        return route

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": 0, "owned_by": "dendrite-nb"}]})

    async def completions(request: Request) -> Response:
        parsed = protocol.parse_completion_request(protocol.read_json(await request.body()))
        engine = state.engine
        prompts, tokens_total = [], 0
        for prompt in parsed.prompts:
            count = len(engine.encode(prompt, at_start=parsed.parent is None)) if isinstance(prompt, str) else len(prompt)
            check_prompt_fits(engine, count, parsed.max_new_tokens, "prompt")
            tokens_total += count
            keep = parsed.echo and parsed.logprobs is not None
            prompts.append(PromptPlan(prompt=prompt, keep_prompt_logprobs=keep))
        response_id = protocol.new_id("cmpl-")
        plan = ChoicePlan(response_id, tuple(prompts), parsed.n, parsed.parent, parsed.max_new_tokens,
                          parsed.sampling, None, parsed.logprobs is not None, parsed.logprobs or 0)
        running = RunningJob(state, plan, blocks_for(engine, tokens_total, plan.num_choices, parsed.max_new_tokens))
        stop = parsed.sampling.stop
        choices = [Choice(engine, stop, parsed.logprobs is not None) for _ in range(plan.num_choices)]
        created = int(time.time())
        if parsed.stream:
            return _stream(running, _completion_events(state, parsed, running, choices, response_id, created))
        info = await _collect(running, choices)
        results = []
        for index, choice in enumerate(choices):
            text, logprobs = choice.stream.text, tuple(choice.logprobs) if choice.keep_logprobs else None
            if parsed.echo:
                prompt_ids, prompt_lps = info["echo"][index // parsed.n]
                text = engine.decode(prompt_ids, skip_end_tokens=True) + text
                if logprobs is not None:
                    logprobs = tuple(protocol.TokenLogprob(engine.decode([t]), lp) for t, lp in
                                     zip(prompt_ids, prompt_lps)) + logprobs
            results.append(protocol.ChoiceResult(text, choice.reason, logprobs))
        return JSONResponse(protocol.completion_body(completion_id=response_id, model=state.model_name, created=created,
                                                 choices=results, usage=_usage(info, choices)))

    async def chat_completions(request: Request) -> Response:
        parsed = protocol.parse_chat_request(protocol.read_json(await request.body()), state.engine.parse_constraint)
        engine = state.engine
        count = _chat_prompt_tokens(engine, parsed.messages, parsed.parent)
        check_prompt_fits(engine, count, parsed.max_new_tokens, "messages")
        response_id = protocol.new_id("chatcmpl-")
        plan = ChoicePlan(response_id, (PromptPlan(messages=parsed.messages),), parsed.n, parsed.parent,
                          parsed.max_new_tokens, parsed.sampling, parsed.constraint_spec, parsed.logprobs,
                          parsed.top_logprobs)
        running = RunningJob(state, plan, blocks_for(engine, count, parsed.n, parsed.max_new_tokens))
        choices = [Choice(engine, parsed.sampling.stop, parsed.logprobs) for _ in range(parsed.n)]
        created = int(time.time())
        if parsed.stream:
            return _stream(running, _chat_events(state, parsed, running, choices, response_id, created))
        info = await _collect(running, choices)
        results = [protocol.ChoiceResult(c.stream.text, c.reason, tuple(c.logprobs) if c.keep_logprobs else None)
                   for c in choices]
        return JSONResponse(protocol.chat_completion_body(completion_id=response_id, model=state.model_name,
                                                      created=created, choices=results, usage=_usage(info, choices)))

    async def responses(request: Request) -> Response:
        parsed = protocol.parse_responses_request(protocol.read_json(await request.body()),
                                                  state.engine.parse_constraint)
        engine = state.engine
        messages = ((protocol.Message("system", parsed.instructions),) if parsed.instructions else ()) + parsed.messages
        count = _chat_prompt_tokens(engine, messages, parsed.previous_response_id)
        check_prompt_fits(engine, count, parsed.max_new_tokens, "input")
        response_id = protocol.new_id("resp_")
        plan = ChoicePlan(response_id, (PromptPlan(messages=messages),), 1, parsed.previous_response_id,
                          parsed.max_new_tokens, parsed.sampling, parsed.constraint_spec)
        running = RunningJob(state, plan, blocks_for(engine, count, 1, parsed.max_new_tokens))
        choice = Choice(engine, parsed.sampling.stop, False)
        created, message_id = int(time.time()), protocol.new_id("msg_")
        if parsed.stream:
            return _stream(running, _response_events(state, parsed, running, choice, response_id, created,
                                                     message_id), events=True)
        info = await _collect(running, [choice])
        return JSONResponse(protocol.response_body(parsed, response_id=response_id, model=state.model_name,
                                               created_at=created, message_id=message_id, text=choice.stream.text,
                                               reason=choice.reason, usage=_usage(info, [choice])))

    async def delete(request: Request) -> Response:
        response_id = request.path_params["response_id"]

        def release(engine: Any) -> bool:
            if response_id not in state.retention:
                return False
            state.retention.release(response_id)
            return True

        found = await asyncio.wrap_future(state.scheduler.call(release))
        if not found:
            raise protocol.APIError(f"no response {response_id!r} is kept here (deleted already, or let go of).",
                                code="response_not_found", status=404)
        kind = "response" if response_id.startswith("resp_") else "chat.completion.deleted"
        return JSONResponse({"id": response_id, "object": kind if kind != "response" else "response.deleted",
                             "deleted": True})

    return Starlette(routes=[
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/responses", guarded(responses), methods=["POST"]),
        Route("/v1/responses/{response_id:path}", guarded(delete), methods=["DELETE"]),
        Route("/v1/chat/completions/{response_id:path}", guarded(delete), methods=["DELETE"]),
    ])


# ---- shared by the routes ------------------------------------------------------------------------------
def _chat_prompt_tokens(engine: Any, messages: tuple, parent: str | None) -> int:
    """The new messages' tokens, as the template writes them (continuing a response adds no BOS or default
    system prompt, so this overcounts such a request by those few tokens)."""
    rendered = engine.format_chat([{"role": m.role, "content": m.content} for m in messages],
                                  add_generation_prompt=True)
    return len(engine.encode(rendered, at_start=parent is None))


def _usage(info: dict[str, Any], choices: list[Choice]) -> protocol.Usage:
    return protocol.Usage(info["prompt_tokens"], sum(len(c.stream.tokens) for c in choices), info["cached_tokens"])


async def _collect(running: RunningJob, choices: list[Choice]) -> dict[str, Any]:
    """Wait for a job to end; its info. Raises the job's error."""
    info: dict[str, Any] = {}
    try:
        async for update in running.updates():
            if update.kind == "failed":
                raise update.error
            if update.kind == "started":
                info = update.info
            elif update.kind == "tokens":
                for index, (token, logprob, top) in update.tokens.items():
                    choices[index].push(token, logprob, top)
            elif update.kind == "ended":
                for index, reason in update.reasons.items():
                    choices[index].reason = _reported(reason)
                    choices[index].stream.finish()
    finally:
        running.cancel()   # a no-op once finished; else the request was abandoned (its client went away)
    return info


def _stream(running: RunningJob, chunks: AsyncIterator[str], events: bool = False) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            running.cancel()   # the client hung up (the generator is closed early): stop and free its branches
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chat_events(state: ServerState, parsed: Any, running: RunningJob, choices: list[Choice],
                       response_id: str, created: int) -> AsyncIterator[str]:
    chunks = protocol.ChatChunks(response_id, state.model_name, created)
    info: dict[str, Any] = {}
    async for update in running.updates():
        if update.kind == "failed":
            yield protocol.sse_error(as_api_error(update.error))
            return
        if update.kind == "started":
            info = update.info
            for index in range(len(choices)):
                yield protocol.sse_data(chunks.role(index))
        elif update.kind == "tokens":
            for index, (token, logprob, top) in update.tokens.items():
                delta, entries = choices[index].push(token, logprob, top)
                if delta or entries:
                    yield protocol.sse_data(chunks.content(index, delta, entries if choices[index].keep_logprobs else None))
        elif update.kind == "ended":
            for index, reason in update.reasons.items():
                choice = choices[index]
                choice.reason = reason
                rest = choice.stream.finish()
                if rest:
                    yield protocol.sse_data(chunks.content(index, rest, [] if choice.keep_logprobs else None))
                yield protocol.sse_data(chunks.finish(index, _reported(reason)))
    if parsed.include_usage:
        yield protocol.sse_data(chunks.usage(_usage(info, choices)))
    yield protocol.SSE_DONE


async def _completion_events(state: ServerState, parsed: Any, running: RunningJob, choices: list[Choice],
                             response_id: str, created: int) -> AsyncIterator[str]:
    chunks = protocol.CompletionChunks(response_id, state.model_name, created)
    engine = state.engine
    info: dict[str, Any] = {}
    async for update in running.updates():
        if update.kind == "failed":
            yield protocol.sse_error(as_api_error(update.error))
            return
        if update.kind == "started":
            info = update.info
            if parsed.echo:
                for index, choice in enumerate(choices):
                    prompt_ids, prompt_lps = info["echo"][index // parsed.n]
                    entries = ([protocol.TokenLogprob(engine.decode([t]), lp) for t, lp in zip(prompt_ids, prompt_lps)]
                               if choice.keep_logprobs else None)
                    yield protocol.sse_data(chunks.text(index, engine.decode(prompt_ids, skip_end_tokens=True), entries))
        elif update.kind == "tokens":
            for index, (token, logprob, top) in update.tokens.items():
                delta, entries = choices[index].push(token, logprob, top)
                if delta or entries:
                    yield protocol.sse_data(chunks.text(index, delta, entries if choices[index].keep_logprobs else None))
        elif update.kind == "ended":
            for index, reason in update.reasons.items():
                choices[index].reason = reason
                rest = choices[index].stream.finish()
                yield protocol.sse_data(chunks.text(index, rest, [] if choices[index].keep_logprobs else None,
                                                _reported(reason)))
    if parsed.include_usage:
        yield protocol.sse_data(chunks.usage(_usage(info, choices)))
    yield protocol.SSE_DONE


async def _response_events(state: ServerState, parsed: Any, running: RunningJob, choice: Choice, response_id: str,
                           created: int, message_id: str) -> AsyncIterator[str]:
    events = protocol.ResponseEvents(parsed, response_id=response_id, model=state.model_name, created_at=created,
                                 message_id=message_id)
    info: dict[str, Any] = {}
    async for update in running.updates():
        if update.kind == "failed":
            yield protocol.sse_event(*events.error(as_api_error(update.error)))
            return
        if update.kind == "started":
            info = update.info
            for event in events.start():
                yield protocol.sse_event(*event)
        elif update.kind == "tokens":
            for token, logprob, top in update.tokens.values():
                delta, _ = choice.push(token, logprob, top)
                if delta:
                    yield protocol.sse_event(*events.delta(delta))
        elif update.kind == "ended":
            choice.reason = next(iter(update.reasons.values()))
            rest = choice.stream.finish()
            if rest:
                yield protocol.sse_event(*events.delta(rest))
    for event in events.finish(_reported(choice.reason), _usage(info, [choice])):
        yield protocol.sse_event(*event)


def _reported(reason: str | None) -> str:
    """A row whose branch was pruned mid-way (a notebook, a DELETE) stopped as if at a natural end."""
    return "eos" if reason in (None, "pruned") else reason
