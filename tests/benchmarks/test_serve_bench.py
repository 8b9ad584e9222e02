"""benchmarks/serve.py's harness, run at a tiny size against stand-in servers (no timing is checked): each chat
re-sends its own history, the requests ask what the workload says, and the table counts requests, output tokens
(from usage or, without it, from stream chunks) and cached tokens right; a server that cannot start or is not
installed gets a row saying why.

The stand-ins are the Starlette apps at the bottom of this file, which serve.py starts as uvicorn subprocesses,
as it starts the real servers. A stand-in answers a request only when its history is the one the harness must
have sent (system prompt, then each earlier question with the stand-in's own answer to it), and otherwise
answers 400, which would turn its row into "unavailable".
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
import zlib
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parents[1] / "benchmarks"
CHATS, TURNS, MAX_TOKENS = 2, 3, 3
CACHED_PER_TURN = 7  # the stand-in reports 7 cached tokens for turn 2, 14 for turn 3, ...


def stand_in_words(messages: list[dict], max_tokens: int) -> list[str]:
    """The stand-in's answer: a tag of the last question (so a history sent to the wrong chat shows), then one
    word per question so far, cut at max_tokens words."""
    questions = sum(m["role"] == "user" for m in messages)
    return ([f"re{zlib.crc32(messages[-1]['content'].encode())}"] + ["ok"] * questions)[:max_tokens]


def request_error(body: dict) -> str | None:
    if body.get("temperature") != 0 or body.get("stream") is not True:
        return f"expected temperature 0 and stream true, got {body.get('temperature')!r}, {body.get('stream')!r}"
    if body.get("stream_options") != {"include_usage": True} or body.get("max_tokens") != MAX_TOKENS:
        return f"expected include_usage and max_tokens {MAX_TOKENS}, got {body.get('stream_options')!r}, " \
               f"{body.get('max_tokens')!r}"
    messages = body["messages"]
    roles = [m["role"] for m in messages]
    questions = len(messages) // 2
    if roles != ["system"] + ["user", "assistant"] * (questions - 1) + ["user"]:
        return f"roles {roles}"
    for index, message in enumerate(messages):
        if message["role"] == "assistant" and message["content"] != " ".join(stand_in_words(messages[:index],
                                                                                              MAX_TOKENS)):
            return f"message {index} is not the answer this stand-in gave: {message['content']!r}"
    return None


def stand_in(with_usage: bool) -> Starlette:
    """An OpenAI-style server of chat completions; with_usage=False streams no usage, as llama-cpp-python's."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def chat(request: Request):
        body = await request.json()
        error = request_error(body) if body["messages"][0]["content"] != "Warm-up." else None
        if error is not None:
            return JSONResponse({"error": {"message": error, "type": "invalid_request_error"}}, status_code=400)
        words = stand_in_words(body["messages"], body["max_tokens"])
        questions = len(body["messages"]) // 2

        def event(delta: dict, finish: str | None = None) -> str:
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "stand-in",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(chunk)}\n\n"

        async def events():
            yield event({"role": "assistant", "content": ""})
            for index, word in enumerate(words):
                yield event({"content": word if index == 0 else f" {word}"})
            yield event({}, "length")
            if with_usage:
                usage = {"prompt_tokens": sum(len(m["content"].split()) for m in body["messages"]),
                         "completion_tokens": len(words), "total_tokens": 0,
                         "prompt_tokens_details": {"cached_tokens": CACHED_PER_TURN * (questions - 1)}}
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "stand-in",
                         "choices": [], "usage": usage}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


usage_app = stand_in(with_usage=True)
plain_app = stand_in(with_usage=False)


def uvicorn_command(app: str):
    return lambda model, port, threads, context: [
        sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), f"test_serve_bench:{app}", "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "warning"]


@pytest.fixture(scope="module")
def bench(real_gguf, tmp_path_factory):
    """(JSON payload, printed output) of serve.py's main on the real model's GGUF (for its tokenizer and floors)
    against the two stand-ins, a server that exits at once, and one that is not installed."""
    out = tmp_path_factory.mktemp("serve") / "serve.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))   # the script imports bench_common and serve_workload from beside it
        spec = importlib.util.spec_from_file_location("benchmark_serve", BENCHMARKS / "serve.py")
        serve = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, spec.name, serve)   # dataclasses look their module up while defining
        spec.loader.exec_module(serve)
        servers = {"stand-in": serve.Server(uvicorn_command("usage_app"), "stand-in", serve.stored_bytes),
                   "stand-in-plain": serve.Server(uvicorn_command("plain_app"), "stand-in", serve.stored_bytes),
                   "broken": serve.Server(lambda *_: [sys.executable, "-c", "import sys; sys.exit('no model here')"],
                                          "stand-in", serve.stored_bytes),
                   "absent": serve.Server(uvicorn_command("usage_app"), "stand-in", serve.stored_bytes,
                                          lambda: "not installed here")}
        for name, server in servers.items():
            patch.setitem(serve.SERVERS, name, server)
        with contextlib.redirect_stdout(printed):
            returned = serve.main(["--model", str(real_gguf), "--servers", *servers, "--chats", str(CHATS),
                                   "--turns", str(TURNS), "--max-tokens", str(MAX_TOKENS), "--system-tokens", "200",
                                   "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload == json.loads(json.dumps(returned, default=str))
    return payload, printed.getvalue()


def row(payload: dict, server: str) -> dict:
    return next(r for r in payload["tables"][0]["rows"] if r["server"] == server)


# Each chat's turn t (1-based) is answered with 1 + t words, cut at MAX_TOKENS.
EXPECTED_OUTPUT = CHATS * sum(min(1 + turn, MAX_TOKENS) for turn in range(1, TURNS + 1))


def test_counts_come_from_the_streams_usage(bench):
    payload, _ = bench
    figures = row(payload, "stand-in")
    assert "unavailable" not in figures   # every history the stand-in got was the one its chat had
    assert figures["requests"] == CHATS * TURNS
    assert figures["output_from"] == "usage" and figures["output_tokens"] == EXPECTED_OUTPUT == 16
    assert figures["cached_tokens"] == CHATS * CACHED_PER_TURN * sum(range(TURNS))
    assert figures["empty_answers"] == figures["cut_off"] == 0 and figures["ttft_p50_ms"] <= figures["ttft_p95_ms"]
    assert math.isclose(figures["output_tok_s"], figures["output_tokens"] / figures["wall_s"])
    # The floor's prompts: most of each is the shared system prompt or the turn its chat sent before.
    assert 0 < figures["ideal_new_tokens"] < figures["prompt_tokens"] / 2
    assert math.isclose(figures["x_floor"], figures["wall_s"] / figures["floor_s"])
    # The stand-in counts words, not the template's tokens, and the note says the counts differ.
    assert figures["prompt_count_mismatches"] == CHATS * TURNS
    assert "stand-in: its usage.prompt_tokens differs from the chat template's count in 6 of 6 requests" \
        in payload["notes"]


def test_without_usage_output_tokens_are_the_chunks_counted(bench):
    payload, _ = bench
    figures = row(payload, "stand-in-plain")
    assert figures["requests"] == CHATS * TURNS
    assert figures["output_from"] == "stream chunks" and figures["output_tokens"] == EXPECTED_OUTPUT
    assert figures["cached_tokens"] is None and figures["prompt_tokens_reported"] is None
    assert any(note.startswith("stand-in-plain: its stream carries no usage") for note in payload["notes"])
    assert "stand-in-plain: 6 of 6 answers equal to stand-in's" in payload["notes"]


def test_a_server_that_cannot_run_gets_a_row_saying_why(bench):
    payload, printed = bench
    assert row(payload, "broken")["unavailable"].startswith("ServerFailed: exited with status 1 before answering")
    assert "no model here" in row(payload, "broken")["unavailable"]
    assert row(payload, "absent")["unavailable"] == "not installed here"
    markdown = [line for line in printed.splitlines() if line.startswith("| ")]
    assert markdown[0].startswith("| server | requests | output tokens | cached tokens |")
    assert "| absent | unavailable: not installed here |" in "\n".join(markdown)
    assert printed.rstrip().splitlines()[-1].startswith("serve wall time: ")


def test_ideal_prefill_counts_the_shared_prefix_once_and_each_turn_past_its_chat():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from serve_workload import ideal_prefill
    finally:
        sys.path.remove(str(BENCHMARKS))
    system = [1, 2, 3, 4]
    first = [(system + [10], [11, 12]), (system + [20], [21])]   # turn 1 of chats 0 and 1
    second = [(system + [10, 11, 12, 13], [14]), (system + [20, 21, 22, 23], [])]
    assert ideal_prefill(first + second) == [(5, 0), (1, 4), (1, 7), (2, 6)]


def test_the_system_prompt_is_cut_at_the_nearest_whole_tool_and_refuses_a_length_beyond_the_catalogue():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import serve_workload
    finally:
        sys.path.remove(str(BENCHMARKS))
    words = lambda text: len(text.split())
    preamble = words(serve_workload.PREAMBLE)
    tool = words(serve_workload.tool_json(*serve_workload.TOOLS[0]))
    # The nearest cut: the preamble alone when the target is nearer it, else the preamble and the first tool.
    assert serve_workload.system_prompt(preamble + tool // 2 - 1, words) == serve_workload.PREAMBLE
    prompt = serve_workload.system_prompt(preamble + tool // 2 + 1, words)
    assert prompt.startswith(serve_workload.PREAMBLE) and prompt.count("\n{") == 1 and prompt.endswith("}\n")
    assert words(prompt) == preamble + tool
    with pytest.raises(SystemExit, match="longer than the whole tool catalogue"):
        serve_workload.system_prompt(10**6, words)
