"""The client side of benchmarks/serve.py: N concurrent multi-turn chats under one long system prompt, sent with
the openai client, streaming, and the figures read off their replies.

Each chat keeps its own message history and re-sends all of it every turn, as agents built on the OpenAI API do.
The chats share their system prompt: a tool-using agent's instructions and tool catalogue (PREAMBLE, TOOLS), cut
at a whole tool once it reaches the asked number of tokens. Every text is fixed, so every run sends the same
requests, up to the answers each server gives.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import openai

PREAMBLE = (
    "You are Ledger, the operations assistant of Northwind Freight, a mid-sized road and sea freight forwarder "
    "with depots in Rotterdam, Hamburg and Lyon. You help the customer service team answer customers about "
    "their shipments, quotes, invoices, stock and claims. Rules: answer in at most three short sentences; never "
    "invent a shipment id, a price or a date, look it up with a tool; confirm with the customer before booking, "
    "cancelling or rerouting anything; say so plainly when a tool returns nothing; never share internal notes or "
    "another customer's data. When a request needs a tool, reply with one call as JSON, "
    '{"tool": NAME, "arguments": {...}}, and nothing else. The tools are:\n'
)

# (name, description, {parameter: (JSON type, description)}); the first parameter is required.
TOOLS: list[tuple[str, str, dict[str, tuple[str, str]]]] = [
    ("search_shipments", "Find shipments by customer, status or booking date. Returns at most 20, newest first.",
     {"customer": ("string", "customer name or account number"),
      "status": ("string", "booked, in_transit, delayed, delivered or cancelled"),
      "since": ("string", "ISO date: only shipments booked on or after it")}),
    ("get_shipment", ("The full record of one shipment: route, carrier, weight, declared value and every "
                      "tracking event with its time and place."),
     {"shipment_id": ("string", "the shipment's id, such as SH-20931")}),
    ("quote_rate", "Price a new shipment between two postal codes. A quote holds for 24 hours.",
     {"origin": ("string", "sender's postal code and country"),
      "destination": ("string", "receiver's postal code and country"),
      "weight_kg": ("number", "gross weight in kilograms"),
      "service": ("string", "economy, standard or express")}),
    ("book_shipment", "Book a quoted shipment. Needs the quote id and the customer's explicit yes in this chat.",
     {"quote_id": ("string", "the id quote_rate returned"),
      "pickup_date": ("string", "ISO date of the pickup, a working day")}),
    ("cancel_shipment", "Cancel a booked shipment before pickup. After pickup, open a claim instead.",
     {"shipment_id": ("string", "the shipment's id"),
      "reason": ("string", "why the customer cancels, in their words")}),
    ("reroute_shipment", "Send a shipment in transit to a new address. Costs a fee the customer must accept first.",
     {"shipment_id": ("string", "the shipment's id"),
      "new_destination": ("string", "full address with postal code and country")}),
    ("open_claim", ("Open a damage or loss claim. Attach photos when the customer has them; a claim closes "
                    "after 30 days without a reply from the customer."),
     {"shipment_id": ("string", "the shipment's id"),
      "kind": ("string", "damage or loss"),
      "description": ("string", "what happened, in the customer's words")}),
    ("check_claim", "The status and history of a claim, with the adjuster's last note to the customer.",
     {"claim_id": ("string", "the claim's id, such as CL-4410")}),
    ("lookup_customer", "Account details: contacts, billing terms, credit limit and open invoices.",
     {"customer": ("string", "customer name or account number")}),
    ("list_invoices", "Invoices of an account with their due dates and the amounts still outstanding.",
     {"customer": ("string", "customer name or account number"),
      "unpaid_only": ("boolean", "only invoices not yet paid in full")}),
    ("warehouse_stock", "Pallets held for a customer at one of our depots, by SKU, with their days in storage.",
     {"depot": ("string", "ROT, HAM or LYS"),
      "customer": ("string", "customer name or account number")}),
    ("schedule_pickup", "Book a pickup slot at the sender's address for a booked shipment.",
     {"shipment_id": ("string", "the shipment's id"),
      "date": ("string", "ISO date of the pickup"),
      "window": ("string", "morning or afternoon")}),
    ("send_email", "Email a customer contact. Plain and polite; never include internal notes.",
     {"to": ("string", "the contact's address, from lookup_customer"),
      "subject": ("string", "one line"),
      "body": ("string", "the message, signed Northwind Freight customer service")}),
    ("escalate", "Hand the chat to a human supervisor with a two-sentence summary of the problem.",
     {"summary": ("string", "what the customer needs and what was tried"),
      "urgency": ("string", "low, normal or high")}),
]

QUESTIONS = [
    "Where is shipment SH-{n}? The customer says it is two days late.",
    "What would 40 kg from 3011 AB Rotterdam to 20095 Hamburg cost by express?",
    "Please cancel SH-{n}, the order was booked twice by mistake.",
    "Does Hanse Textil GmbH still have unpaid invoices?",
    "A parcel of SH-{n} arrived with a crushed corner. What do I do?",
    "Book a pickup for SH-{n} tomorrow morning, please.",
    "How many pallets do we hold for Hanse Textil in Hamburg?",
    "Write a short apology email for the delay of SH-{n}.",
]


def tool_json(name: str, description: str, parameters: dict[str, tuple[str, str]]) -> str:
    properties = {key: {"type": kind, "description": text} for key, (kind, text) in parameters.items()}
    schema = {"type": "object", "properties": properties, "required": [next(iter(parameters))]}
    return json.dumps({"type": "function", "function": {"name": name, "description": description,
                                                         "parameters": schema}})


def system_prompt(target_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """PREAMBLE and whole tool definitions, one a line: of the cuts at a tool's end, the one whose length (as
    `count_tokens` counts it) is nearest `target_tokens`, so the prompt never ends inside a tool."""
    text, length = PREAMBLE, count_tokens(PREAMBLE)
    for tool in TOOLS:
        if length >= target_tokens:
            return text
        longer = text + tool_json(*tool) + "\n"
        longer_length = count_tokens(longer)
        if longer_length >= target_tokens and target_tokens - length < longer_length - target_tokens:
            return text
        text, length = longer, longer_length
    if length < target_tokens:
        raise SystemExit(f"--system-tokens {target_tokens:,} is longer than the whole tool catalogue "
                         f"({length:,} tokens); ask for at most that many.")
    return text


def user_message(chat: int, turn: int) -> str:
    """A short question, different for each chat and turn (so no two histories are the same after the system
    prompt), the same in every run."""
    question = QUESTIONS[(3 * chat + turn) % len(QUESTIONS)].format(n=20000 + 10 * chat + turn)
    return f"Ticket {chat + 1}.{turn + 1}: {question}"


@dataclass(frozen=True)
class Workload:
    chats: int  # concurrent conversations
    turns: int  # requests per conversation, one after the other
    max_tokens: int  # per answer
    system: str  # the shared system prompt


class Reply(NamedTuple):
    chat: int
    turn: int
    messages: list[dict[str, str]]  # the history sent, ending with this turn's user message
    text: str  # the answer's content, streamed
    ttft_s: float | None  # request sent -> first content chunk; None for an answer without content
    seconds: float  # request sent -> stream ended
    content_chunks: int  # chunks that carried content (llama-cpp-python streams one a token)
    finish_reason: str | None  # None: the stream ended without saying why the answer stopped (cut off)
    completion_tokens: int | None  # from the stream's usage chunk; None when the server sends none
    prompt_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None when not reported


def client(base_url: str) -> openai.AsyncOpenAI:
    # No retries: a failed request must show as a failure, not as a slow one.
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=900.0)


async def ask(api: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]], max_tokens: int, chat: int = -1,
              turn: int = -1) -> Reply:
    """One streamed chat completion at temperature 0, asking for usage in the stream."""
    started = time.perf_counter()
    stream = await api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                               stream=True, stream_options={"include_usage": True})
    ttft_s, parts, usage, finish_reason = None, [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started
                parts.append(choice.delta.content)
            finish_reason = choice.finish_reason or finish_reason
    details = getattr(usage, "prompt_tokens_details", None)
    return Reply(chat, turn, messages, "".join(parts), ttft_s, time.perf_counter() - started, len(parts),
                 finish_reason, usage.completion_tokens if usage else None, usage.prompt_tokens if usage else None,
                 details.cached_tokens if details is not None else None)


async def run_chats(base_url: str, model: str, workload: Workload) -> tuple[list[Reply], float]:
    """(every reply, in the order they finished; wall seconds from the first request to the last answer)."""
    api = client(base_url)
    replies: list[Reply] = []

    async def converse(chat: int) -> None:
        history = [{"role": "system", "content": workload.system}]
        for turn in range(workload.turns):
            history.append({"role": "user", "content": user_message(chat, turn)})
            reply = await ask(api, model, list(history), workload.max_tokens, chat, turn)
            history.append({"role": "assistant", "content": reply.text})
            replies.append(reply)

    started = time.perf_counter()
    async with api:
        await asyncio.gather(*(converse(chat) for chat in range(workload.chats)))
    return replies, time.perf_counter() - started


async def warm_up(base_url: str, model: str) -> None:
    """One short request that shares no text with the workload, so that first-call costs are not in its figures."""
    async with client(base_url) as api:
        await ask(api, model, [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hi."}], 4)


def figures(replies: Sequence[Reply], wall_s: float) -> dict[str, Any]:
    """Counts and rates of one server's run. Output tokens come from the stream's usage, or, from a server that
    sends none, are the content chunks counted (`output_from` says which)."""
    with_usage = [r for r in replies if r.completion_tokens is not None]
    if len(with_usage) not in (0, len(replies)):
        raise ValueError(f"the server sent usage with {len(with_usage)} of {len(replies)} streamed answers; "
                           f"the counts would mix two sources")
    output = sum(r.completion_tokens if with_usage else r.content_chunks for r in replies)
    cached = [r.cached_tokens for r in replies]
    ttft_ms = [r.ttft_s * 1e3 for r in replies if r.ttft_s is not None]
    return {
        "requests": len(replies),
        "output_tokens": output,
        "output_from": "usage" if with_usage else "stream chunks",
        "prompt_tokens_reported": sum(r.prompt_tokens for r in replies) if with_usage else None,
        "cached_tokens": None if None in cached else sum(cached),
        "empty_answers": sum(r.ttft_s is None for r in replies),
        "cut_off": sum(r.finish_reason is None for r in replies),
        "wall_s": wall_s,
        "output_tok_s": output / wall_s,
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)) if ttft_ms else None,
        "ttft_p95_ms": float(np.percentile(ttft_ms, 95)) if ttft_ms else None,
    }


def ideal_prefill(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[int, int]]:
    """(new tokens, tokens already cached) per request for a server that keeps the KV of every earlier request's
    prompt and answer: what a request must still prefill is its prompt past the longest prefix it shares with one
    of them. `requests`: (prompt ids, answer ids), in an order where each turn comes after the turn it continues
    (by turn, then chat), so that the shared system prompt counts once, in the first chat's first turn."""
    seen: list[Sequence[int]] = []
    result = []
    for prompt, answer in requests:
        prompt = list(prompt)
        cached = max((len(os.path.commonprefix([prompt, list(earlier)])) for earlier in seen), default=0)
        result.append((len(prompt) - cached, cached))
        seen.append([*prompt, *answer])
    return result
