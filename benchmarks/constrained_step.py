"""Decode-step time with and without llguidance constraints, at batch 1, 16 and 64, and the mask's share.

Each batch size runs the same forked branches twice: unconstrained (the peer and the floor: a
constraint should add nothing beyond it), and under a JSON schema that cannot complete within the
measured steps. Printed per batch: the mean step time of each (only steps with the whole batch
active), the time llguidance spent filling masks (on its worker thread, overlapped with the forward),
the part of it the decode loop actually waited for, and applying the masks to the logits.

    python benchmarks/constrained_step.py [--steps 64] [--batches 1 16 64] [--device cpu] [--repeats 3]
                                          [--vocab 128000]

The test checkpoints' tokenizer has 512 tokens. Mask cost grows with the vocabulary, so `--vocab N`
instead trains a byte-level BPE of N tokens on a synthetic Zipf-distributed corpus (about 10 s for
128,000) and pairs it with the same tiny random model, widened to that vocabulary.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import string
import tempfile
import time

import torch

from dendrite_nb import Engine, SamplingParams, StepHistory
from dendrite_nb.model.config import ModelConfig
from dendrite_nb.model.loader import random_model
from dendrite_nb.testing import TINY_SHAPES, write_tiny_checkpoint

# An array of long strings: valid JSON all along, never complete within the measured steps.
SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 4000}, "minItems": 2}


class Timings:
    """Wraps the engine's Guidance to time mask filling, waiting and applying."""

    def __init__(self, guidance):
        self.fill_s = self.wait_s = self.apply_s = 0.0
        fill, start_fill, apply = guidance.fill, guidance.start_fill, guidance.apply

        def timed_fill(matchers):
            started = time.perf_counter()
            try:
                return fill(matchers)
            finally:
                self.fill_s += time.perf_counter() - started

        def timed_start_fill(matchers):
            future = guidance._filler.submit(timed_fill, matchers)
            result = future.result

            def timed_result(*args):
                started = time.perf_counter()
                try:
                    return result(*args)
                finally:
                    self.wait_s += time.perf_counter() - started

            future.result = timed_result
            return future

        def timed_apply(logits, rows, bitmask):
            started = time.perf_counter()
            apply(logits, rows, bitmask)
            self.apply_s += time.perf_counter() - started

        guidance.fill, guidance.start_fill, guidance.apply = timed_fill, timed_start_fill, timed_apply


def large_vocab_engine(vocab_size: int, device: str) -> Engine:
    """The tiny llama shape with random weights and a BPE of `vocab_size` tokens trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(2, 12))) for _ in range(200_000)]
    corpus = " ".join(rng.choices(words, weights=[1 / (i + 1) for i in range(len(words))], k=1_500_000))
    corpus += " " + string.printable   # every JSON character, as its own token at least
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens(["<|end_of_text|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end_of_text|>")
    config = ModelConfig.from_hf(TINY_SHAPES["llama-gqa-untied"].hf_config(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    return Engine(random_model(config, torch.device(device), torch.float32), tokenizer, device=device,
                  num_blocks=4096, block_size=16)


def mean_full_batch_step_s(history: StepHistory, batch: int) -> float:
    full = [s for s, b in zip(history.step_s, history.batch_sizes) if b == batch]
    return statistics.mean(full[1:] if len(full) > 1 else full)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=None, help="train a BPE of this many tokens (default: 512)")
    args = parser.parse_args()
    if args.vocab is None:
        checkpoint = write_tiny_checkpoint(tempfile.mkdtemp(), "llama-gqa-untied")
        engine = Engine.from_pretrained(checkpoint, device=args.device, num_blocks=4096, block_size=16)
    else:
        engine = large_vocab_engine(args.vocab, args.device)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"device {args.device}; tiny llama-gqa-untied, vocab {engine.config.vocab_size:,}")
    # Warm up: the LLTokenizer is built once per engine, and the mask kernel compiles per batch shape.
    for batch in args.batches:
        kids = engine.fork(engine.new_branch(f"warm{batch}", "x"), batch)
        engine.generate(kids, 3, SamplingParams(ignore_eos=True), constraint={"json_schema": SCHEMA})
        engine.prune(f"warm{batch}", kids)
    timings = Timings(engine._grammars.guidance)
    print(f"{'batch':>5} {'free step ms':>13} {'constrained ms':>15} {'overhead':>9} {'fill ms':>8} "
          f"{'waited ms':>10} {'apply ms':>9}   (per step)")
    for batch in args.batches:
        results = {}   # per kind, the fastest of the repeats (alternated: run order moves CPU times a lot here)
        for constrained in [False, True] * args.repeats:
            root = engine.new_branch(f"b{batch}", "Write the list as JSON:")
            kids = engine.fork(root, batch)
            if constrained:
                for kid in kids:
                    engine.constrain(kid, {"json_schema": SCHEMA})
            history = StepHistory()
            before = (timings.fill_s, timings.wait_s, timings.apply_s)
            with engine.subscribe(history):
                engine.generate(kids, args.steps, SamplingParams(temperature=1.0, seed=0, ignore_eos=True))
            spent = [(now - then) / len(history) for now, then in zip((timings.fill_s, timings.wait_s, timings.apply_s),
                                                                       before)]
            measured = (mean_full_batch_step_s(history, batch), spent)
            if constrained not in results or measured[0] < results[constrained][0]:
                results[constrained] = measured
            engine.prune(root, kids)
        (free_s, _), (constrained_s, (fill_s, wait_s, apply_s)) = results[False], results[True]
        print(f"{batch:>5} {1e3 * free_s:>13.2f} {1e3 * constrained_s:>15.2f} {100 * (constrained_s / free_s - 1):>8.0f}% "
              f"{1e3 * fill_s:>8.2f} {1e3 * wait_s:>10.2f} {1e3 * apply_s:>9.2f}")
    print("\nfloor: the unconstrained step of the same batch; fill runs on the worker thread during the forward, "
          "'waited' is the part the decode loop blocked on")


if __name__ == "__main__":
    main()
