"""This engine and llama.cpp on one GPU, side by side in one run, on the same random Qwen3-0.6B-shape weights, the
same token ids and greedy decoding: the 1,000-fork first step, fan-out over one document, tree of thought,
best-of-16, SGLang's tree_of_thought_deep shape, fork cost, an MCTS and a prefill (issue 42).

The weights: bench_common.build_model's random real-shape model (bf16 on the GPU), written once as a GGUF of the
same tensors (peers/random_gguf.py; f16 by default: these bf16 values convert to f16 exactly) with a made-up
vocabulary of the model's size. --gguf reuses a file written earlier from the same shape, device and seed (say,
while llama.cpp compiles); the sanity lines at the start compare the two systems' logits on one prompt, which a
different file would fail.

Systems, one after the other in this process, never at once:
  engine      dendrite_nb's Engine around that model: bf16 weights and KV, the default attention, CUDA graphs
              (the engine's defaults on CUDA), public API only (new_branch, fork, append_many, generate, prune);
              on a GPU each call waits for the device before it returns (peers/systems.py).
  llama.cpp   llama-cpp-python built with CUDA, every layer on the GPU (n_gpu_layers -1), in a worker process of
              its own (peers/llama_worker.py: it never shares a process with torch; it times each run there),
              through peers/llama_cpp_peer.py: sequence ids of one unified KV cache, llama_decode with every sequence of a
              step in one batch, llama_memory_seq_cp for a fork and seq_rm for a prune; KV f16. Its settings are
              searched per workload (peers/sweep.py): flash attention on and off, and the greedy choice made on
              the host from the logits it hands back or by its backend sampler in the decode's graph. The backend
              sampler is experimental in llama.cpp: it is first tried in a child process, and left out if that
              fails.
Each system is reported at its fastest variant per workload; every variant's run is listed too.

Timing: wall time of the workload's timed part, the median of --repeats runs, the two systems' fastest variants
alternating. Before its timed runs, each system at each setting runs the whole workload once untimed (CUDA graph
captures for the workload's shapes, llama.cpp's graph reservations). Floors, from the model and the copy bandwidth
and bf16 matmul rate measured in the same run: each forward a workload needs at least (peers/workloads.py) costs the
larger of (the weights once + the KV of its context once + the KV it writes) over the copy bandwidth and its FLOPs
over the matmul rate. Both systems read the same weight bytes (bf16 and f16), so one floor serves both.

llama.cpp holds at most LLAMA_MAX_SEQ (256) sequence ids in a context: the 1,000-fork step runs on the engine alone,
and both systems run it at llama.cpp's limit (255 leaves beside the prefix's own sequence).

    python benchmarks/llama_cpp_gpu.py [--gguf PATH] [--repeats 3] [--mcts-scale 0.2] [--workloads ...]
        [--llama-flash-attn on off] [--llama-backend-sampling off on] [--budget-s S] [--json PATH] [--smoke]
"""
from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench_common import (Column, Report, build_model, engine_variant, log, measure_floors, model_costs, parser,
                          setup as make_setup)
from peers.backend_probe import backend_sampling_works
from peers.llama_types import LlamaSetting
from peers.llama_worker import LlamaWorker, RemoteSession
from peers.quiet import Guard
from peers.report_text import first_difference, seconds_text, tokens_text
from peers.sweep import Outcome, Trial, Variant, open_session, run_once, run_workload, warm_run
from peers.systems import GREEDY, EngineSystem
from peers.random_gguf import WEIGHT_TYPES, write_random_gguf
from peers.workloads import (BestOfN, FanOut, ForkCost, ForkStep, Forward, Mcts, Prefill, Texts, TreeOfThought,
                             TreeOfThoughtDeep)

SHAPE = "qwen3-0.6b"
WORKLOADS = ["fork-step", "fanout", "tot", "best16", "tot-deep", "fork", "mcts", "prefill"]  # most wanted first
ON_OFF = {"on": True, "off": False}
SANITY_TOKENS = 16
BLOCK_SIZE = 16
SMOKE_LEAVES = 260  # past llama.cpp's 256 sequence ids: a smoke run takes the engine-only path too
# Token counts of the CPU comparison's texts (peers/texts.py through SmolLM2's chat template): an instruction, the
# chat prompt, an MCTS move marker, tree_of_thought_deep's first prompts and its three later turns.
INSTRUCTION_TOKENS, CHAT_TOKENS, MOVE_TOKENS = (16, 19), 54, 5
PLAN_TOKENS, SEGMENT_TOKENS = [101, 110, 94, 93], [43, 27, 25]


def random_texts(vocab_size: int, document: int, instructions: int, moves: int, seed: int = 7) -> Texts:
    """The workloads' token ids, drawn at random (the model has no tokenizer): the CPU comparison's lengths."""
    rng = random.Random(seed)

    def draw(count: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(count)]

    return Texts(document=draw(document), instructions=[draw(rng.randint(*INSTRUCTION_TOKENS))
                                                        for _ in range(instructions)],
                 chat_prompt=draw(CHAT_TOKENS), moves=[draw(MOVE_TOKENS) for _ in range(moves)],
                 plan_prompts=[draw(n) for n in PLAN_TOKENS], deep_segments=[draw(n) for n in SEGMENT_TOKENS])


def sizes(args, smoke: bool) -> dict:
    if smoke:
        return dict(document=64, step_leaves=[args.leaves or SMOKE_LEAVES, 6], fork_lengths=[64], forks=8, fanout=(4, 4), tot=(16, 3, 2, 4),
                    best=(4, 4), deep=(1, 2, 3), mcts=(2, 3, 4, 3))
    expansions = max(1, round(50 * args.mcts_scale))
    return dict(document=2048, step_leaves=[args.leaves or 1000, None], fork_lengths=[2048], forks=64, fanout=(32, 32),
                tot=(256, 5, 4, 24), best=(16, 64), deep=(args.tot_deep_questions, 2, args.tot_deep_tokens),
                mcts=(expansions, 20, 50, 16))


def make_workloads(chosen: list[str], texts: Texts, size: dict, llama_leaves: int) -> list:
    made = []
    for name in chosen:
        if name == "fork-step":
            leaves = [n if n is not None else llama_leaves for n in size["step_leaves"]]
            made += [ForkStep(texts, size["document"], n) for n in dict.fromkeys(leaves)]
        elif name == "fanout":
            made.append(FanOut(texts, size["document"], *size["fanout"]))
        elif name == "tot":
            made.append(TreeOfThought(texts, *size["tot"]))
        elif name == "best16":
            made.append(BestOfN(texts, *size["best"]))
        elif name == "tot-deep":
            made.append(TreeOfThoughtDeep(texts, *size["deep"]))
        elif name == "fork":
            made += [ForkCost(texts, length, size["forks"]) for length in size["fork_lengths"]]
        elif name == "mcts":
            made.append(Mcts(texts, *size["mcts"]))
        elif name == "prefill":
            made.append(Prefill(texts, size["document"]))
    return made


def parse(argv: list[str] | None):
    arguments = parser(__doc__)
    arguments.add_argument("--gguf", type=Path, default=None,
                           help="the model as a GGUF: written here if missing (default: a temporary file)")
    arguments.add_argument("--gguf-type", choices=sorted(WEIGHT_TYPES), default=None,
                           help="2-D tensors of a GGUF written here (default f16; f32 in a smoke run)")
    arguments.add_argument("--repeats", type=int, default=3)
    arguments.add_argument("--leaves", type=int, default=None,
                           help=f"the engine's many-fork step (fork_decode.py; default 1000, smoke {SMOKE_LEAVES})")
    arguments.add_argument("--mcts-scale", type=float, default=0.2,
                           help="share of the full MCTS (50 expansions, 1,000 rollouts of 50 tokens); default 0.2")
    arguments.add_argument("--tot-deep-questions", type=int, default=4, help="1..4 (default 4)")
    arguments.add_argument("--tot-deep-tokens", type=int, default=64, help="tokens per answer (SGLang: up to 256)")
    arguments.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=WORKLOADS)
    arguments.add_argument("--llama-flash-attn", nargs="+", choices=sorted(ON_OFF), default=["on", "off"])
    arguments.add_argument("--llama-backend-sampling", nargs="+", choices=sorted(ON_OFF), default=["off", "on"])
    arguments.add_argument("--llama-threads", type=int, default=min(8, os.cpu_count() or 1),
                           help="llama.cpp's CPU threads (its work is on the GPU; default min(8, CPUs))")
    arguments.add_argument("--budget-s", type=float, default=None,
                           help="start no workload after this many seconds (those left are listed as not run)")
    arguments.add_argument("--commit", default=None, help="what the run's notes name as the commit (default: git's)")
    args = arguments.parse_args(argv)
    if args.repeats < 1 or (args.leaves or 1) < 1 or args.mcts_scale <= 0 or args.tot_deep_tokens < 1:
        arguments.error("--repeats, --leaves and --tot-deep-tokens must be at least 1, --mcts-scale above 0")
    if not 1 <= args.tot_deep_questions <= len(PLAN_TOKENS):
        arguments.error(f"--tot-deep-questions must be within 1..{len(PLAN_TOKENS)}")
    return args


# ---- floors and sanity ------------------------------------------------------------------------------
def floor_seconds(forwards: list[Forward], costs, floors) -> float | None:
    """Each forward: the larger of (weights + its context's KV once + the KV it writes) / copy bandwidth and its
    FLOPs / matmul rate."""
    if not forwards:
        return None
    return sum(floors.seconds(costs.weight_bytes + costs.kv_bytes(f.context + f.rows * f.tokens),
                              f.rows * costs.prefill_flops(f.tokens, f.context)) for f in forwards)


def sanity_lines(engine, worker: LlamaWorker, settings: list[LlamaSetting], prompt: list[int]) -> list[str]:
    """The engine's next-token logits on `prompt` against llama.cpp's, and greedy tokens at each setting."""
    branch = engine.new_branch("sanity", prompt)
    ours_logits = engine.next_logits([branch])[0].float().cpu()
    (ours,) = engine.generate([branch], SANITY_TOKENS, GREEDY)
    engine.prune(branch)
    lines = []
    for setting in settings:
        logits, theirs = worker.sanity(setting, prompt, SANITY_TOKENS)
        if logits is not None:
            theirs_logits = torch.from_numpy(logits)
            same = int(theirs_logits.argmax()) == int(ours_logits.argmax())
            lines.append(f"sanity: next-token logits on a {len(prompt)}-token prompt, llama.cpp {setting.describe()} "
                         f"against the engine: max |difference| {(theirs_logits - ours_logits).abs().max().item():.3g}"
                         f" (largest |logit| {ours_logits.abs().max().item():.3g}); argmax "
                         f"{'the same' if same else 'DIFFERS'}")
        where = first_difference(ours, theirs)
        lines.append(f"sanity: greedy, {SANITY_TOKENS} tokens, llama.cpp {setting.describe()}: "
                     + ("equal to the engine's" if where is None else
                        f"differ from the engine's from token {where}: {theirs} vs {ours}"))
    return lines


# ---- the run ----------------------------------------------------------------------------------------
def engine_only(workload, texts: Texts, variant: Variant, repeats: int, guard: Guard, why: str) -> Outcome:
    """A workload llama.cpp cannot run (more sequences than it holds): the engine's trials alone."""
    log(f"\n{workload.name}\n  llama.cpp: {why}")
    trial = Trial(variant)
    run_once(trial, workload, texts, guard, log)
    if repeats > 1:
        session = open_session(variant, workload, texts)
        try:
            for _ in range(repeats - 1):
                trial.runs.append(session.run(guard, log)[0])
        finally:
            session.close()
    load = os.getloadavg()[0]
    return Outcome(workload, [trial], {"engine": trial}, (load, load))


def engine_blocks(workloads: list) -> int:
    """KV blocks for the largest workload: its tokens, and per sequence a copied tail block and a partial one."""
    return max(-(-w.cells() // BLOCK_SIZE) + 2 * w.sequences() for w in workloads) + 256


def add_rows(summary, detail, outcome: Outcome, costs, floors, llama_missing: str | None) -> None:
    workload, engine = outcome.workload, outcome.best["engine"]
    llama = outcome.best.get("llama.cpp")
    for metric in workload.metrics:
        floor_s = floor_seconds(metric.forwards, costs, floors)
        engine_s = engine.median(metric.key)
        row = dict(workload=metric.label, engine=seconds_text(engine_s), engine_s=engine_s,
                   engine_runs=[r[metric.key] for r in engine.runs], floor=seconds_text(floor_s), floor_s=floor_s,
                   engine_x_floor=engine_s / floor_s if floor_s else None)
        if llama is None:
            row |= dict(llama="-", llama_variant=f"unavailable: {llama_missing}")
        else:
            llama_s = llama.median(metric.key)
            ratio = engine_s / llama_s
            row |= dict(llama=seconds_text(llama_s), llama_s=llama_s, llama_variant=llama.variant.setting,
                        llama_runs=[r[metric.key] for r in llama.runs], ratio=ratio,
                        faster=f"engine {1 / ratio:.2f}x" if ratio < 1 else f"llama.cpp {ratio:.2f}x",
                        llama_x_floor=llama_s / floor_s if floor_s else None, tokens=tokens_text(llama, engine))
        summary.add(**row)
    key = workload.metrics[0].key
    for trial in outcome.trials:
        label = f"{trial.variant.system} {trial.variant.setting}"
        if trial.unavailable:
            detail.add(workload=workload.metrics[0].label, variant=label, unavailable=trial.unavailable)
            continue
        judged = trial in outcome.best.values()
        detail.add(workload=workload.metrics[0].label, variant=label, run=seconds_text(trial.runs[0][key]),
                   run_s=trial.runs[0][key], median=seconds_text(trial.median(key)) if judged else "",
                   tokens=tokens_text(trial, outcome.trials[0]))


def write_partial(report: Report, path: Path | None) -> None:
    """The tables so far, so that a run cut short still leaves its finished workloads behind."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"script": report.script, "machine": report.machine, "partial": True,
                                    "notes": report.notes, "tables": [{"title": t.title, "rows": t.rows}
                                                                      for t in report.tables]}, indent=1, default=str))


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    started = time.perf_counter()
    setup = make_setup(args)
    report = Report("llama_cpp_gpu", setup)
    report.floors = measure_floors(setup)
    model = build_model(setup, setup.hf_config(SHAPE))
    gguf_type = args.gguf_type or ("f16" if setup.device.type == "cuda" else "f32")
    gguf = (args.gguf.resolve() if args.gguf   # absolute: the llama.cpp worker runs in another folder
            else Path(tempfile.mkdtemp(prefix="llama_cpp_gpu_")) / f"{setup.shape_name(SHAPE)}.{gguf_type}.gguf")
    if not gguf.is_file():
        write_random_gguf(model, gguf, gguf_type)
        log(f"wrote {gguf} ({gguf.stat().st_size / 1e6:,.0f} MB)")
    n_gpu_layers = -1 if setup.device.type == "cuda" else 0
    worker = LlamaWorker(gguf, n_gpu_layers)
    try:
        return run(args, argv, started, setup, report, model, gguf, gguf_type, worker)
    finally:
        worker.close()


def run(args, argv, started: float, setup, report: Report, model, gguf: Path, gguf_type: str,
        worker: LlamaWorker) -> dict:
    on_gpu, floors = setup.device.type == "cuda", report.floors
    costs = model_costs(model, setup.dtype)
    backend_choices = [ON_OFF[v] for v in args.llama_backend_sampling]
    if True in backend_choices:
        usable, seen = backend_sampling_works(gguf, worker.n_gpu_layers)
        log(f"llama.cpp's backend sampler: {seen}")
        report.note(f"llama.cpp's backend sampler (greedy in the decode's graph), tried in a child process first: "
                    f"{seen}{'' if usable else '; left out of the settings'}")
        if not usable:
            backend_choices = [v for v in backend_choices if not v] or [False]
    info = worker.info()
    llama_max_seq = info["max_sequences"]
    size = sizes(args, setup.smoke)
    texts = random_texts(model.config.vocab_size, max(size["document"], size["tot"][0], *size["fork_lengths"]),
                         instructions=max(8, size["fanout"][0]), moves=size["mcts"][0])
    workloads = make_workloads(args.workloads, texts, size, llama_max_seq - 1)
    engine, reason = engine_variant(model, setup, "auto", None, block_size=BLOCK_SIZE,
                                    num_blocks=engine_blocks(workloads))
    if engine is None:
        raise SystemExit(f"the engine cannot run here: {reason}")
    engine_label = (f"{str(setup.dtype).removeprefix('torch.')}, attention {engine.backend.name}, CUDA graphs "
                    f"{'on' if engine._graphs is not None else 'off'}")
    log(f"{setup.shape_name(SHAPE)}: {engine.config.describe()}; engine {engine_label}; llama.cpp {gguf_type}, "
        f"n_gpu_layers {worker.n_gpu_layers}, in its own process")
    reference = LlamaSetting(args.llama_threads, ON_OFF[args.llama_flash_attn[0]], "f16")
    sanity_settings = [reference] + ([LlamaSetting(args.llama_threads, reference.flash_attn, "f16", True)]
                                     if True in backend_choices else [])
    for line in sanity_lines(engine, worker, sanity_settings, texts.chat_prompt):
        report.note(line)
        log(line)

    engine_variants = [Variant("engine", engine_label, costs.weight_bytes,
                               lambda workload: warm_run(EngineSystem(engine, "engine"), workload), False)]

    def llama_variant(name: str, setting: LlamaSetting) -> Variant:
        return Variant("llama.cpp", f"{name}, {setting.describe()}", costs.weight_bytes, None, True,
                       session=lambda workload, texts: RemoteSession(worker, name, setting, workload, texts))

    knobs = {"threads": [args.llama_threads], "flash_attn": [ON_OFF[v] for v in args.llama_flash_attn],
             "kv_type": ["f16"], "backend_sampling": backend_choices}
    summary = report.table(
        f"engine and llama.cpp on {'the GPU' if on_gpu else setup.device.type}, each at its fastest setting per "
        f"workload (wall time, median of {args.repeats} runs; ratio < 1: the engine is faster; floor: weights + KV "
        f"once per forward / copy bandwidth, or FLOPs / matmul rate)",
        [Column("workload", "workload", label=True), Column("engine", "engine"), Column("llama", "llama.cpp"),
         Column("llama_variant", "llama.cpp setting", label=True), Column("ratio", "engine / llama.cpp", "{:.2f}"),
         Column("faster", "faster"), Column("floor", "floor"), Column("engine_x_floor", "engine x floor", "{:.1f}"),
         Column("llama_x_floor", "llama.cpp x floor", "{:.1f}"), Column("tokens", "llama.cpp tokens")])
    detail = report.table("every variant's first run, by workload (tokens: against the engine's)",
                          [Column("workload", "workload", label=True), Column("variant", "variant", label=True),
                           Column("run", "run"), Column("median", f"median of {args.repeats}"),
                           Column("tokens", "tokens")])
    guard = Guard(attempts=1)   # a GPU machine runs nothing else; its figures are not redone
    skipped, failed = [], []
    for workload in workloads:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            skipped.append(workload.name)
            continue
        try:
            if workload.sequences() > llama_max_seq:
                why = (f"llama.cpp holds at most {llama_max_seq} sequence ids in a context (LLAMA_MAX_SEQ); "
                       f"this needs {workload.sequences():,}")
                outcome = engine_only(workload, texts, engine_variants[0], args.repeats, guard, why)
                add_rows(summary, detail, outcome, costs, floors, why)
            else:
                outcome = run_workload(workload, texts, engine_variants, [gguf_type], knobs, llama_variant,
                                       args.repeats, False, guard, log)
                add_rows(summary, detail, outcome, costs, floors, None)
        except (Exception, SystemExit) as error:   # SystemExit: run_workload's "no llama.cpp variant could run"
            # A GPU run is rare and costly: a workload that fails is reported with its error, and the others go on.
            log(traceback.format_exc())
            if engine.branches:   # what the failed run left behind would crowd the next workloads' KV blocks
                engine.prune(list(engine.branches))
            failed.append(f"{workload.name}: {type(error).__name__}: {error}")
        write_partial(report, args.json)
    if skipped:
        report.note(f"not run, --budget-s {args.budget_s:g} s spent: {'; '.join(skipped)}")
    for line in failed:
        report.note(f"FAILED: {line}")
    if "mcts" in args.workloads and not setup.smoke:
        report.note(f"MCTS at --mcts-scale {args.mcts_scale:g} of the issue's 50 expansions and 1,000 rollouts "
                    f"(rollouts per expansion and lengths as in the issue)")
    report.note(f"{setup.shape_name(SHAPE)} random weights (seed 0), {costs.weight_bytes / 1e9:.2f} GB read per "
                f"forward; engine {engine_label}, {engine.pool.num_blocks:,} KV blocks of {BLOCK_SIZE}; llama.cpp: "
                f"llama-cpp-python {info['version']} in a process of its own, GGUF {gguf_type} "
                f"({gguf.stat().st_size / 1e6:,.0f} MB), n_gpu_layers {worker.n_gpu_layers}, {args.llama_threads} "
                f"CPU threads, KV f16, unified KV cache, n_batch 512")
    report.note("llama.cpp hands a sampled token back at once and feeds it with the next llama_decode (as its batched "
                "examples do); the engine's generate writes each sampled token's KV within its step. So a generate "
                "of n tokens costs llama.cpp one forward less than the engine (fan-out's first tokens: llama.cpp takes "
                "them from the instructions' logits, the engine also feeds them). The many-fork step feeds them on "
                "both (peers/systems.py's step).")
    report.note("prefix reuse on (the engine's default): a prompt a live branch already holds is not prefilled again")
    commit = args.commit
    if commit is None:
        try:
            from serve import git_commit
            commit = git_commit()
        except ImportError as error:   # serve.py needs httpx and openai
            commit = f"unknown ({error})"
    report.note(f"commit {commit}; command: python benchmarks/llama_cpp_gpu.py {' '.join(argv or sys.argv[1:])}")
    return report.finish(args.json)


if __name__ == "__main__":
    faulthandler.enable()   # a crash in native code (CUDA, Triton) still says where Python was
    main()
