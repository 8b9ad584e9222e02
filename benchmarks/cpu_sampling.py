"""Temperature sampling on the CPU: the engine's sampler next to the other ways to draw the same tokens.

A sampled decode step on the CPU ends with dendrite_nb.sampling.sample over [rows, vocab] float32 logits, each
row drawing from its own branch's generator. With a 0.6B model's 151,936-token vocabulary that draw is most of
the step's host time, so it is measured here on its own. Variants, on the same logits and generators:

  engine              sample(): softmax, then the exponential race argmax(p / E), E = -log(uniform)
  race, exponential_  the same race with E from Tensor.exponential_ (the engine's draw before 2026-11-25)
  multinomial         torch.multinomial on each row's softmax (how transformers' sampler draws)

Floor: the logits read once (rows x vocab x 4 bytes) at the copy bandwidth measured in the same run.

    python benchmarks/cpu_sampling.py [--rows 1 8 64] [--vocab 151936] [--repeats 30] [--json PATH] [--smoke]
"""
from __future__ import annotations

import statistics

import torch

from bench_common import Column, Report, Setup, log, measure_floors, parser, time_calls
from dendrite_nb.sampling import SamplingParams, sample

TEMPERATURE = 0.8
QWEN3_VOCAB = 151_936


def race_with_exponential(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def multinomial(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    return torch.cat([torch.multinomial(probs[row], 1, generator=generator)
                      for row, generator in enumerate(generators)])


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--rows", type=int, nargs="+", default=None, help="rows per draw (default 1 8 64)")
    arguments.add_argument("--vocab", type=int, default=None, help=f"default {QWEN3_VOCAB:,} (smoke: 4,096)")
    arguments.add_argument("--repeats", type=int, default=None, help="timed draws per variant (default 30)")
    args = arguments.parse_args(argv)
    setup = Setup(torch.device(args.device or "cpu"), torch.float32, args.smoke)
    row_counts = args.rows or ([1, 4] if setup.smoke else [1, 8, 64])
    vocab = args.vocab or (4096 if setup.smoke else QWEN3_VOCAB)
    repeats = args.repeats or (3 if setup.smoke else 30)
    report = Report("cpu_sampling", setup)
    report.floors = floors = measure_floors(setup)
    log(f"{torch.get_num_threads()} threads, vocabulary {vocab:,}, temperature {TEMPERATURE}")
    table = report.table(f"temperature sampling, vocabulary {vocab:,} (median of {repeats} draws; floor: the logits "
                         "read once at the copy bandwidth)",
                         [Column("rows", "rows", label=True), Column("variant", "variant", label=True),
                          Column("ms", "ms", "{:.3f}"), Column("ms_per_row", "ms / row", "{:.3f}"),
                          Column("floor_ms", "floor ms", "{:.4f}"), Column("vs_engine", "x engine", "{:.2f}")])
    params = SamplingParams(temperature=TEMPERATURE)
    variants = [("engine", lambda logits, gens: sample(logits, params, gens)),
                ("race, exponential_", race_with_exponential),
                ("multinomial", multinomial)]
    for rows in row_counts:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows), device=setup.device) * 4
        generators = [torch.Generator(setup.device).manual_seed(row) for row in range(rows)]
        floor_ms = floors.seconds(logits.numel() * logits.element_size()) * 1e3
        engine_ms = None
        for name, draw in variants:
            tokens = draw(logits, generators)
            if tokens.shape != (rows,) or not bool(((tokens >= 0) & (tokens < vocab)).all()):
                raise AssertionError(f"{name} drew {tokens.tolist()[:8]}..., not one token in range per row")
            ms = statistics.median(time_calls(lambda: draw(logits, generators), setup.device, repeats,
                                              warmup=1)) * 1e3
            engine_ms = engine_ms or ms
            table.add(rows=str(rows), variant=name, ms=ms, ms_per_row=ms / rows, floor_ms=floor_ms,
                      vs_engine=ms / engine_ms)
            log(f"  {rows:>3} rows  {name:<20} {ms:8.3f} ms ({ms / rows:.3f} ms a row; floor {floor_ms:.4f} ms)")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
