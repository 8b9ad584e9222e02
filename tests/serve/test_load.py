"""A bounded load test on localhost: 32 concurrent clients, 8 turns each, on the demo model on the CPU. Nothing is
lost, the responses at temperature 0 equal the same requests run alone (one turn of each client, every turn four
times), and once every response is deleted the pool is full again."""
import asyncio

import httpx
import openai
import pytest

from dendrite_nb.serve.server import Server

CLIENTS, TURNS, MAX_TOKENS = 32, 8, 2  # 2-token answers
SYSTEM = "You are a terse assistant. Answer in a few words."


def question(client: int, turn: int) -> str:
    # Short (8-9 tokens, was 18): every turn prefills its question, one request at a time, which was most of the
    # engine's time here.
    return f"What is {client} plus {turn}?"


async def converse(api: openai.AsyncOpenAI, client: int, log: list) -> None:
    """One client's conversation: each turn re-sends the whole history, as agents do."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": question(client, turn)})
        reply = await api.chat.completions.create(model="m", messages=list(messages), max_tokens=MAX_TOKENS,
                                                  temperature=0)
        text = reply.choices[0].message.content
        log.append((client, turn, list(messages), text, reply.id, reply.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": text})


async def load(url: str) -> list:
    log: list = []
    limits = httpx.Limits(max_connections=CLIENTS * 2)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        api = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
        await asyncio.gather(*(converse(api, client, log) for client in range(CLIENTS)))
    return log


@pytest.mark.timeout(900)
def test_32_clients_8_turns_each(demo_engine):
    engine = demo_engine(num_blocks=2048)
    server = Server(engine, port=0).start()
    try:
        log = asyncio.run(load(server.url))
        assert len(log) == CLIENTS * TURNS                                   # nothing lost
        assert server.scheduler.max_rows_seen > 1                            # they really shared steps
        assert sum(cached for *_, cached in log) > 0                         # the shared system prompt was reused
        # Requests again, alone: the same reply, token for token (greedy), whatever it shared a step with. One turn
        # of each client (turn client % TURNS: each turn four times, at every batch position), 32 of the 256: all
        # 256 one after another took about half of this test's 200 s in CI.
        api = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        sample = [(messages, text) for client, turn, messages, text, *_ in log if turn == client % TURNS]
        assert len(sample) == CLIENTS
        for messages, text in sample:
            alone = api.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            assert alone.choices[0].message.content == text, messages[-1]["content"]
        ids = server.scheduler.call(lambda e: [name for name in e.branches]).result(60)
        with httpx.Client() as http:   # one client: each new one builds an SSL context, 16 s for the 256 deletes
            for response_id in ids:
                assert http.delete(f"{server.url}/chat/completions/{response_id}").status_code == 200
        def emptied(e):
            live, cached = len(e.branches), e.num_cached_blocks
            e.audit()
            return live, e.num_free_blocks + cached, e.drop_cache(), e.num_free_blocks
        live, free_or_cached, _, free = server.scheduler.call(emptied).result(60)
        assert live == 0
        assert free_or_cached == engine.num_blocks   # only evictable cache holds blocks
        assert free == engine.num_blocks             # and once the cache is dropped, the pool is full
    finally:
        server.stop()
