"""Our OpenAI-compatible server next to llama.cpp's, on N concurrent multi-turn chats that share a long system
prompt (issue 41), on the CPU, the same GGUF model for every server.

Servers, each started here as a subprocess on a free port of 127.0.0.1, waited for (GET /v1/models), sent one
warm-up request, driven, and stopped, one after the other:
  dendrite            python -m dendrite_nb serve MODEL --device cpu --dtype float32: automatic prefix reuse (the
                      server's default)
  dendrite-no-reuse   the same with --no-prefix-reuse: every prompt prefilled whole
  llama.cpp           llama-cpp-python's server (python -m llama_cpp.server, `pip install llama-cpp-python[server]`,
                      built from the PyPI source for the CPU), on the GGUF as stored. It serves one request at a
                      time, one llama_context behind a lock, and keeps the KV of the longest prefix a prompt shares
                      with the one before it. --interrupt_requests False: by default a request that arrives
                      ends the stream being served, mid-answer. Its stream carries no usage: its output tokens
                      are its content chunks counted (one a token), and it reports no cached tokens.
Every server gets --threads CPU threads (default: torch's, what the engine uses): OMP_NUM_THREADS, and for
llama.cpp n_threads and n_threads_batch.

Workload (serve_workload.py): --chats conversations at once, --turns turns each, each turn a short user message
and an answer of at most --max-tokens at temperature 0, streamed through the openai client, each chat re-sending
its whole history every turn; the chats share a system prompt of about --system-tokens tokens (an agent's
instructions and tool catalogue). Figures per server: output tokens/s over the whole run (first request sent to
last answer done), time to first token p50/p95, requests, and the cached prompt tokens its usage reports.

Floors, from the GGUF's tensors and the copy bandwidth and float32 matmul rate measured in the same run:
  decode step   the weights one step reads (every layer, the final norm, the LM head), as the server holds them
                (the engine: dequantized to float32; llama.cpp: the file's quantized blocks), over the copy
                bandwidth, or the step's FLOPs (2 x parameters x rows) over the matmul rate if larger. KV reads
                are left out, so this floor is low for long contexts.
  prefill       FLOPs (bench_common.ModelCosts.prefill_flops) over the float32 matmul rate: compute bound. For
                llama.cpp, whose quantized kernels run at other rates than torch's float32 matmul, a reference.
  run           the answers' decode steps with all chats in every step, plus the prefill of only what an ideal
                prefix cache lacks (serve_workload.ideal_prefill, on the prompts as the GGUF's chat template
                renders them and the answers as the tokenizer encodes them). "floor tok/s" is output tokens over it.
  TTFT          per request, the prefill of what an ideal cache lacks, alone (weights read once, or its FLOPs).

    python benchmarks/serve.py [--servers dendrite dendrite-no-reuse llama.cpp] [--chats 8] [--turns 4]
                               [--max-tokens 32] [--system-tokens 600] [--threads N] [--model GGUF] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import torch

from bench_common import Column, Floors, ModelCosts, Report, Setup, log, measure_floors
from dendrite_nb import demo_model
from dendrite_nb.model.gguf import GGUFCheckpoint, open_gguf
from dendrite_nb.model.gguf_tokenizer import gguf_tokenizer
from serve_workload import Reply, Workload, figures, ideal_prefill, run_chats, system_prompt, warm_up

HOST = "127.0.0.1"
REPOSITORY = Path(__file__).resolve().parents[1]


def llama_cpp_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
    if importlib.util.find_spec("sse_starlette") is None:
        return "llama-cpp-python's server extras are not installed (pip install 'llama-cpp-python[server]')"
    return None


@dataclass(frozen=True)
class Server:
    command: Callable[[Path, int, int, int], list[str]]  # (model, port, threads, context tokens) -> argv
    weights: str  # how it holds the weights, for the decode floor
    tensor_bytes: Callable[[Any], int]  # bytes of one GGUF tensor (gguf's ReaderTensor) as the server holds it
    missing: Callable[[], str | None] = lambda: None  # why it cannot run here; None when it can


def dendrite(*flags: str) -> Callable[[Path, int, int, int], list[str]]:
    return lambda model, port, threads, context: [
        sys.executable, "-m", "dendrite_nb", "serve", str(model), "--host", HOST, "--port", str(port),
        "--device", "cpu", "--dtype", "float32", *flags]


def llama_cpp(model: Path, port: int, threads: int, context: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", HOST, "--port", str(port),
            "--n_ctx", str(context), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--interrupt_requests", "False"]


def float32_bytes(tensor: Any) -> int:
    return int(tensor.n_elements) * 4


def stored_bytes(tensor: Any) -> int:
    return int(tensor.n_bytes)


SERVERS = {
    "dendrite": Server(dendrite(), "float32, dequantized from the GGUF", float32_bytes),
    "dendrite-no-reuse": Server(dendrite("--no-prefix-reuse"), "float32, dequantized from the GGUF", float32_bytes),
    "llama.cpp": Server(llama_cpp, "the GGUF's own blocks", stored_bytes, llama_cpp_missing),
}


# ---- a server's process -----------------------------------------------------------------------
class ServerFailed(RuntimeError):
    """The server could not be started, or stopped answering."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def log_tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:]) or "(it printed nothing)"


@contextlib.contextmanager
def running(server: Server, model: Path, threads: int, context: int, timeout_s: float) -> Iterator[tuple[str, str]]:
    """(base URL, model id) of the server, started and answering GET /v1/models; stopped on leaving."""
    port = free_port()
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as folder:
        log_path = Path(folder) / "server.log"
        with log_path.open("wb") as output:
            process = subprocess.Popen(server.command(model, port, threads, context), stdout=output,
                                       stderr=subprocess.STDOUT, env=environment, cwd=REPOSITORY)
        try:
            base_url = f"http://{HOST}:{port}"
            yield base_url, wait_until_ready(process, base_url, log_path, timeout_s)
            if process.poll() is not None:
                raise ServerFailed(f"exited with status {process.returncode} during the run: {log_tail(log_path)}")
        finally:
            stop(process)


def wait_until_ready(process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> str:
    """The id of the first model GET /v1/models lists, once it answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"exited with status {process.returncode} before answering GET /v1/models: "
                               f"{log_tail(log_path)}")
        try:
            response = httpx.get(f"{base_url}/v1/models", timeout=5.0)
        except httpx.TransportError:   # not listening yet
            time.sleep(0.25)
            continue
        try:
            models = response.json()["data"] if response.status_code == 200 else None
        except (ValueError, KeyError, TypeError):   # not JSON, or not a model list: said below
            models = None
        if not models:
            raise ServerFailed(f"GET /v1/models answered {response.status_code} {response.text[:200]!r}, not a "
                               f"list of models")
        return models[0]["id"]
    raise ServerFailed(f"did not answer GET /v1/models within {timeout_s:.0f} s: {log_tail(log_path)}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ---- floors -----------------------------------------------------------------------------------
def gguf_costs(checkpoint: GGUFCheckpoint, tensor_bytes: Callable[[Any], int]) -> ModelCosts:
    """What one forward of the GGUF's model moves and computes, its weights held as `tensor_bytes` counts them."""
    config = checkpoint.config
    tensors = {t.name: t for t in checkpoint.reader.tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    # An untied embedding table is only indexed (B rows); a tied one is read whole as the LM head.
    read = [t for name, t in tensors.items() if name != "token_embd.weight" or config.tie_word_embeddings]
    return ModelCosts(
        weight_bytes=sum(tensor_bytes(t) for t in read),
        layer_params=sum(int(t.n_elements) for name, t in tensors.items() if name.startswith("blk.")),
        head_params=int(head.n_elements),
        kv_bytes_per_token=0,   # the floors here leave KV reads out
        attention_flops_per_pair=4 * config.num_layers * config.num_heads * config.head_dim,
    )


def decode_step_s(costs: ModelCosts, floors: Floors, rows: int) -> float:
    return floors.seconds(costs.weight_bytes, rows * 2 * (costs.layer_params + costs.head_params))


def token_ids(tokenizer: Any, reply: Reply) -> tuple[list[int], list[int]]:
    """(the prompt as the GGUF's chat template renders it, the answer as the tokenizer encodes it)."""
    prompt = tokenizer.apply_chat_template(reply.messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    return list(prompt), tokenizer.encode(reply.text, add_special_tokens=False)


def floor_figures(replies: list[Reply], tokenizer: Any, costs: ModelCosts, floors: Floors,
                  chats: int, output_tokens: int) -> dict[str, Any]:
    ordered = sorted(replies, key=lambda r: (r.turn, r.chat))
    ids = [token_ids(tokenizer, r) for r in ordered]
    prefill = ideal_prefill(ids)
    prefill_s = sum(costs.prefill_flops(new, cached) for new, cached in prefill) / floors.matmul_flop_per_s
    # Each answer's first token comes from its prefill; the rest from steps that carry every chat at once.
    decode_s = max(output_tokens - len(replies), 0) / chats * decode_step_s(costs, floors, chats)
    ttft_floor_ms = [floors.seconds(costs.weight_bytes, costs.prefill_flops(new, cached)) * 1e3
                     for new, cached in prefill]
    mismatched = sum(r.prompt_tokens is not None and r.prompt_tokens != len(prompt)
                     for r, (prompt, _) in zip(ordered, ids))
    return {"prompt_tokens": sum(len(prompt) for prompt, _ in ids),
            "ideal_new_tokens": sum(new for new, _ in prefill),
            "floor_s": prefill_s + decode_s,
            "ttft_floor_p50_ms": float(np.percentile(ttft_floor_ms, 50)),
            "prompt_count_mismatches": mismatched}


# ---- the run ----------------------------------------------------------------------------------
def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPOSITORY, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPOSITORY,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):   # not a checkout: the note says so, the run goes on
        return "unknown (not a git checkout)"
    return commit + (" with uncommitted changes" if dirty else "")


def context_tokens(system_tokens: int, turns: int, max_tokens: int) -> int:
    """A context that holds a whole chat: the system prompt and, per turn, a question, an answer and the
    template's tokens around them (64 is more than they take), rounded up to 1,024."""
    needed = system_tokens + turns * (max_tokens + 64)
    return max(2048, -(-needed // 1024) * 1024)


def main(argv: list[str] | None = None) -> dict:
    arguments = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_argument("--servers", nargs="+", choices=sorted(SERVERS), default=list(SERVERS))
    arguments.add_argument("--chats", type=int, default=8, help="concurrent conversations (default 8)")
    arguments.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    arguments.add_argument("--max-tokens", type=int, default=32, help="answer length limit (default 32)")
    arguments.add_argument("--system-tokens", type=int, default=600, help="about this long (default 600)")
    arguments.add_argument("--threads", type=int, default=torch.get_num_threads(),
                           help=f"CPU threads of every server (default: torch's, here {torch.get_num_threads()})")
    arguments.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the demo model)")
    arguments.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for a server")
    arguments.add_argument("--json", type=Path, default=None, help="also write the figures here as JSON")
    args = arguments.parse_args(argv)
    for name in ("chats", "turns", "max_tokens", "system_tokens", "threads"):
        if getattr(args, name) < 1:
            arguments.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    model = (args.model or demo_model()).resolve()
    report = Report("serve", Setup(torch.device("cpu"), torch.float32, smoke=False))
    report.floors = floors = measure_floors(report.setup)
    checkpoint = open_gguf(model)
    tokenizer = gguf_tokenizer(checkpoint.path, checkpoint.metadata, checkpoint.num_tokens)
    system = system_prompt(args.system_tokens, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    system_tokens = len(tokenizer.encode(system, add_special_tokens=False))
    workload = Workload(args.chats, args.turns, args.max_tokens, system)
    context = context_tokens(system_tokens, args.turns, args.max_tokens)
    log(f"{args.chats} chats x {args.turns} turns, answers of at most {args.max_tokens} tokens at temperature 0, "
        f"a {system_tokens}-token system prompt; {model.name}; {args.threads} threads")
    table = report.table(
        f"{args.chats} concurrent chats x {args.turns} turns under one {system_tokens}-token system prompt, "
        f"answers <= {args.max_tokens} tokens, {model.name}, CPU, {args.threads} threads "
        "(floor: decode steps at full batch + prefill of what an ideal prefix cache lacks)",
        [Column("server", "server", label=True), Column("requests", "requests", "{:,}"),
         Column("output_tokens", "output tokens", "{:,}"), Column("cached_tokens", "cached tokens", "{:,}"),
         Column("prompt_tokens", "prompt tokens", "{:,}"), Column("wall_s", "wall s", "{:.1f}"),
         Column("output_tok_s", "output tok/s", "{:.1f}"), Column("floor_tok_s", "floor tok/s", "{:.1f}"),
         Column("x_floor", "x floor", "{:.1f}"), Column("ttft_p50_ms", "TTFT p50 ms", "{:,.0f}"),
         Column("ttft_p95_ms", "TTFT p95 ms", "{:,.0f}"), Column("ttft_floor_p50_ms", "TTFT floor p50 ms", "{:,.0f}")])
    answers: dict[str, dict[tuple[int, int], str]] = {}
    for name in args.servers:
        server = SERVERS[name]
        costs = gguf_costs(checkpoint, server.tensor_bytes)
        step_1, step_n = decode_step_s(costs, floors, 1), decode_step_s(costs, floors, args.chats)
        report.note(f"{name}: weights {server.weights}, {costs.weight_bytes / 1e6:,.0f} MB read a decode step; "
                    f"decode floor {step_1 * 1e3:.1f} ms a step of 1 row, {step_n * 1e3:.1f} ms of {args.chats} "
                    f"({args.chats / step_n:,.0f} tok/s)")
        missing = server.missing()
        if missing is not None:
            table.add(server=name, unavailable=missing)
            log(f"{name}: unavailable: {missing}")
            continue
        log(f"{name}: starting")
        load_before = os.getloadavg()[0]
        try:
            with running(server, model, args.threads, context, args.startup_timeout) as (base_url, model_id):
                asyncio.run(warm_up(base_url, model_id))
                replies, wall_s = asyncio.run(run_chats(base_url, model_id, workload))
            row = figures(replies, wall_s)
        except (ServerFailed, openai.OpenAIError, httpx.HTTPError, ValueError) as error:
            table.add(server=name, unavailable=f"{type(error).__name__}: {error}")
            log(f"{name}: unavailable: {type(error).__name__}: {error}")
            continue
        row.update(floor_figures(replies, tokenizer, costs, floors, args.chats, row["output_tokens"]))
        row.update(server=name, floor_tok_s=row["output_tokens"] / row["floor_s"], x_floor=wall_s / row["floor_s"],
                   load_average=(load_before, os.getloadavg()[0]))
        table.add(**row)
        answers[name] = {(r.chat, r.turn): r.text for r in replies}
        log(f"{name}: {row['requests']} requests, {row['output_tokens']:,} output tokens in {wall_s:.1f} s = "
            f"{row['output_tok_s']:.1f} tok/s (floor {row['floor_tok_s']:.1f}); TTFT p50 {row['ttft_p50_ms']:,.0f} "
            f"ms, p95 {row['ttft_p95_ms']:,.0f} ms")
        # Other work on the machine slows every figure: the 1-minute load average around each run says how much.
        report.note(f"{name}: load average {load_before:.1f} before, {row['load_average'][1]:.1f} after "
                    f"({os.cpu_count()} CPUs)")
        if row["output_from"] != "usage":
            report.note(f"{name}: its stream carries no usage: output tokens are its content chunks counted, "
                        f"and it reports no cached tokens")
        if row["prompt_count_mismatches"]:
            report.note(f"{name}: its usage.prompt_tokens differs from the chat template's count in "
                        f"{row['prompt_count_mismatches']} of {row['requests']} requests")
        if row["empty_answers"] or row["cut_off"]:
            report.note(f"{name}: {row['empty_answers']} answers had no content, {row['cut_off']} streams ended "
                        f"without a finish_reason (cut off)")
    system_prefill_s = floors.seconds(0, gguf_costs(checkpoint, stored_bytes).prefill_flops(system_tokens, 0))
    report.note(f"prefill floor (FLOPs over the float32 matmul rate; for llama.cpp a reference): the "
                f"{system_tokens}-token system prompt {system_prefill_s * 1e3:,.0f} ms "
                f"({system_prefill_s / system_tokens * 1e3:.2f} ms a token)")
    if len(answers) > 1:
        first, *others = answers
        for name in others:
            same = sum(answers[name].get(key) == text for key, text in answers[first].items())
            report.note(f"{name}: {same} of {len(answers[first])} answers equal to {first}'s")
    report.note(f"threads: {args.threads} for every server (OMP_NUM_THREADS; llama.cpp: n_threads, n_threads_batch); "
                f"llama.cpp's n_ctx {context:,}; one warm-up request per server, not counted")
    report.note(f"commit {git_commit()}; command: python benchmarks/serve.py {' '.join(argv or sys.argv[1:])}")
    log()
    log(table.markdown())
    return report.finish(args.json)


if __name__ == "__main__":
    main()
