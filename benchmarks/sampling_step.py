"""Sampling's share of a decode step, by batch size: greedy, the torch path, and the fused kernels.

Issue 42 asks that sampling with top-p, top-k, temperature and min-p cost at most about 5% of a step at every batch
size from 1 to 256, each branch keeping its own generator. For 1, 4, 16, 64 and 256 rows of random float32 logits
at Qwen3's 151,936-token vocabulary, each row with its own CUDA generator, it times:
- greedy: logits.argmax(-1), what any sampler costs at least;
- torch: sampling.filter_probs then exponential_race, the path the GPU took for top-k and top-p before the fused
  kernel (a sort of [rows, vocab], a cumulative sum, a scatter, then one noise launch per row);
- fused: sampling.sample, one launch of kernels/filtered_sample.py; its chunks' candidates settle these rows;
- fused, top-p only: top-p 0.9 alone, whose nucleus over these near-flat logits holds thousands of tokens, past
  what the chunks keep: the rows go on to kernels/filtered_passes.py's passes, the slow case;
- race: temperature alone, kernels/race_sample.py, for reference.
torch and fused sample at top-p 0.9, top-k 50, min-p 0.05, temperature 0.8. Each time is the median of many calls,
each between two CUDA events (after warm-up calls), so where the host's launches are the bottleneck the time counts
them, as a decode step pays them. Beside it: the floor (the logits read once at the copy bandwidth measured here)
and, with --step-ms, the share of a decode step of that many milliseconds. Every call's tokens are checked first:
each row's token is one its settings keep.

    python benchmarks/sampling_step.py [--rows 1 4 16 64 256] [--vocab 151936] [--step-ms 0.92 1.13 1.83 ...]
                                       [--calls 100] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/sampling_step.py --check   # CPU: a tiny vocabulary, interpreted

--check (or bench_common's --smoke) runs every variant on a 96-token vocabulary in Triton's interpreter and checks
its tokens, so a CPU test (tests/benchmarks/test_sampling_step.py) keeps the script working between GPU runs.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench_common import Column, Report, Setup, log, measure_floors, parser
from dendrite_nb.sampling import SamplingParams, exponential_race, filter_probs, sample

QWEN3_VOCAB = 151_936
ROWS = (1, 4, 16, 64, 256)
CHECK_VOCAB, CHECK_ROWS = 96, (1, 4)
LOGIT_SCALE = 2.0  # random logits: randn x 2, so at temperature 0.8 a top-p 0.9 nucleus holds ~10% of the tokens
FILTERED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)
TOP_P_ONLY = SamplingParams(temperature=0.8, top_p=0.9)
TEMPERATURE_ONLY = SamplingParams(temperature=0.8)
WARMUP_CALLS = 5
TARGET_SHARE = 0.05  # of a step (issue 42)


def variants(logits: torch.Tensor, generators: list[torch.Generator]
             ) -> list[tuple[str, SamplingParams | None, Callable[[], torch.Tensor]]]:
    """(name, the settings its tokens must satisfy (None: greedy), one call). On the CPU (--check) the fused and race
    kernels run directly, each row keyed (row, 0): a CPU generator has no Philox offset to key them by."""
    calls = [("greedy", None, lambda: logits.argmax(dim=-1)),
             ("torch", FILTERED, lambda: exponential_race(filter_probs(logits, FILTERED), generators))]
    if logits.is_cuda:
        for name, params in (("fused", FILTERED), ("fused, top-p only", TOP_P_ONLY), ("race", TEMPERATURE_ONLY)):
            calls.append((name, params, lambda params=params: sample(logits, params, generators)))
        return calls
    from dendrite_nb.kernels.filtered_sample import FilteredSampler
    from dendrite_nb.kernels.race_sample import RaceSampler

    rows = len(generators)
    filtered, race = FilteredSampler(logits.device), RaceSampler(logits.device)
    keys = (list(range(rows)), [0] * rows)
    for name, params in (("fused", FILTERED), ("fused, top-p only", TOP_P_ONLY)):
        calls.append((name, params, lambda p=params: filtered(logits, [p.temperature] * rows, [p.top_k] * rows,
                                                              [p.top_p] * rows, [p.min_p] * rows, *keys)))
    calls.append(("race", TEMPERATURE_ONLY, lambda: race(logits, TEMPERATURE_ONLY.temperature, *keys)))
    return calls


def check_tokens(name: str, tokens: torch.Tensor, logits: torch.Tensor, params: SamplingParams | None) -> None:
    """Each row's token is one its settings keep (greedy: the argmax)."""
    if params is None:
        allowed = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).bool()
    else:
        allowed = filter_probs(logits, params) > 0
    bad = (~allowed.gather(1, tokens.view(-1, 1))).flatten().nonzero().flatten().tolist()
    if tokens.shape != (len(logits),) or bad:
        raise SystemExit(f"{name} drew a token its settings cut, in rows {bad[:8]} of {len(logits)}.")


def checked_ms(name: str, fn: Callable[[], torch.Tensor], logits: torch.Tensor, params: SamplingParams | None,
               calls: int) -> float:
    """Median milliseconds of one call of fn, between CUDA events on a GPU (after WARMUP_CALLS calls), once its
    tokens are checked; on the CPU (--check) the checked call's own time, which shows only that it ran (interpreted)."""
    started = time.perf_counter()
    check_tokens(name, fn(), logits, params)
    if not logits.is_cuda:
        return (time.perf_counter() - started) * 1e3
    for _ in range(WARMUP_CALLS):
        fn()
    times = []
    for _ in range(calls):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--check", action="store_true",
                           help="a 96-token vocabulary on the CPU in Triton's interpreter; every call checked")
    arguments.add_argument("--rows", nargs="+", type=int, default=None, help="rows per step (default 1 4 16 64 256)")
    arguments.add_argument("--vocab", type=int, default=None, help=f"default {QWEN3_VOCAB:,}")
    arguments.add_argument("--step-ms", nargs="+", type=float, default=None,
                           help="a decode step's milliseconds, one for all row counts or one per row count: each "
                                "time is also shown as a share of it")
    arguments.add_argument("--calls", type=int, default=None, help="timed calls per variant (default 100)")
    args = arguments.parse_args(argv)
    check = args.check or args.smoke
    if check:
        device = torch.device("cpu")
    elif not torch.cuda.is_available() or (args.device or "cuda") == "cpu":
        raise SystemExit("sampling_step times CUDA kernels; run it on a GPU (--check runs a tiny vocabulary on the "
                         "CPU).")
    else:
        device = torch.device(args.device or "cuda")
    if check:
        from dendrite_nb import kernels

        if not kernels.INTERPRETED:
            raise SystemExit("--check runs the kernels in Triton's interpreter, which must be on before triton is "
                             "imported: TRITON_INTERPRET=1 python benchmarks/sampling_step.py --check")
    row_counts = args.rows or list(CHECK_ROWS if check else ROWS)
    vocab = args.vocab or (CHECK_VOCAB if check else QWEN3_VOCAB)
    calls = args.calls or 100
    step_ms = args.step_ms or []
    if len(step_ms) not in (0, 1, len(row_counts)):
        raise SystemExit(f"--step-ms takes one time for every row count or one per row count ({len(row_counts)}); "
                         f"got {len(step_ms)}.")
    steps = dict(zip(row_counts, step_ms if len(step_ms) > 1 else step_ms * len(row_counts)))
    setup = Setup(device, torch.float32, smoke=check)
    floors = measure_floors(setup, matmul=False)
    report = Report("sampling_step", setup, floors)
    columns = [Column("rows", "rows", label=True), Column("variant", "variant", label=True),
               Column("ms", "ms", "{:.3f}"), Column("floor_ms", "floor ms", "{:.4f}"),
               Column("x_floor", "x floor", "{:.1f}"), Column("step_share", "of step", "{:.1%}")]
    timing = "one checked call, interpreted" if check else f"median of {calls} calls"
    table = report.table(f"Sampling {vocab:,}-token float32 logits, a generator per row ({timing}; "
                         f"floor: the logits read once); torch and fused at top-p 0.9, top-k 50, min-p 0.05, "
                         f"temperature 0.8", columns)
    for rows in row_counts:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(device) * LOGIT_SCALE
        generators = [torch.Generator(device).manual_seed(row) for row in range(rows)]
        floor_ms = floors.seconds(logits.numel() * logits.element_size()) * 1e3
        for name, params, fn in variants(logits, generators):
            ms = checked_ms(name, fn, logits, params, calls)
            share = ms / steps[rows] if rows in steps else None
            table.add(rows=str(rows), variant=name, ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms, step_share=share)
            log(f"  {rows:>3} rows  {name:<18} {ms:8.3f} ms (floor {floor_ms:.4f} ms"
                + (f", {share:.1%} of a {steps[rows]} ms step)" if share is not None else ")"))
        if rows in steps:
            fused = next(r for r in table.rows if r["rows"] == str(rows) and r["variant"] == "fused")
            verdict = "within" if fused["step_share"] <= TARGET_SHARE else "over"
            report.note(f"{rows} rows: fused sampling is {fused['step_share']:.1%} of a {steps[rows]} ms step, "
                        f"{verdict} the {TARGET_SHARE:.0%} target")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
