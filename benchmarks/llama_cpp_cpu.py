"""This engine and llama.cpp on the CPU, side by side in one run, on the same GGUF weights, the same token ids and
greedy decoding: prefill, fork cost, fan-out, tree of thought, best-of-16, an MCTS and SGLang's
tree_of_thought_deep shape (issue 42).

Systems, one after the other, never at once (the machine has 2 cores):
  engine      dendrite_nb's Engine.from_pretrained(MODEL, device="cpu", dtype=D[, weights=W]), public API only
              (new_branch, fork, append_many, generate, prune); --dtypes float32 bfloat16 by default, and each
              --weights format (int8, int4; "none", the default: the dtype itself) passed as weights=. The GGUF's
              blocks are dequantized into D at load (and requantized into W).
  llama.cpp   llama-cpp-python's low-level bindings (peers/llama_cpp_peer.py): sequence ids of one unified KV cache
              (kv_unified), llama_decode with every sequence of a step in one batch, llama_memory_seq_cp for a fork
              and seq_rm for a prune. --llama-weights picks the GGUF files it runs: the model as stored (its own
              type, e.g. q4_1) and copies written in f32 / bf16 / q8_0 (peers/gguf_copies.py) into --copies-dir;
              each dequantizes to the engine's weights up to that type's rounding.
Settings: llama.cpp at threads (--llama-threads), flash attention on/off and KV cache type (--llama-kv), searched
per workload (peers/sweep.py: coordinate-wise from the first value of each, or --full-grid); the engine at each
dtype, weight format and --engine-threads count. Each system is reported at its fastest variant per workload,
named; every variant's run is listed too.

Timing: wall time (time.perf_counter) of the workload's timed part, after an untimed warm-up of each system; the
figure is the median of --repeats runs, the fastest variants of the two systems alternating (peers/sweep.py). The
process CPU time of the same runs is printed beside it. A run during which the rest of the machine used more than a
quarter of a core is redone after a quiet moment (peers/quiet.py); the 'others' column says what they used.
Floors, from the GGUF's tensors and the copy bandwidth and float32 matmul rate measured in the same run: each forward
a workload needs at least (peers/workloads.py) costs the larger of the weights it reads once (as that variant holds
them) over the copy bandwidth, and its FLOPs over the float32 matmul rate (for llama.cpp's quantized kernels, a
reference); KV reads are left out. Greedy tokens: llama.cpp's are checked against the engine's at the start, and each
variant's tokens in each workload are compared with the first engine variant's.

    python benchmarks/llama_cpp_cpu.py [--model GGUF] [--dtypes float32 bfloat16] [--weights none int8 int4]
        [--engine-threads 2 1]
        [--llama-weights q4_1 f32 bf16 q8_0] [--llama-threads 2 1] [--llama-flash-attn off on] [--llama-kv f16 f32]
        [--full-grid] [--repeats 3] [--mcts-scale 0.1] [--workloads ...] [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

import torch

from bench_common import Floors, Report, Setup, log, measure_copy_bandwidth, measure_matmul_rate
from dendrite_nb import DendriteError, Engine, demo_model
from dendrite_nb.model.gguf import open_gguf
from dendrite_nb.paths import default_cache_dir
from peers import report as tables
from peers.gguf_copies import COPY_TYPES, gguf_copy
from peers.llama_cpp_peer import LlamaCppModel, LlamaSetting
from peers.quiet import Guard
from peers.sweep import WARM_UP_CELLS, WARM_UP_SEQUENCES, Variant, run_workload
from peers.llama_system import LlamaSystem
from peers.systems import EngineSystem
from peers.texts import QUESTIONS, make_texts
from peers.workloads import BestOfN, FanOut, ForkCost, Mcts, Prefill, TreeOfThought, TreeOfThoughtDeep
from serve import git_commit, gguf_costs, stored_bytes

WORKLOADS = ["prefill", "fork", "fanout", "tot", "best16", "mcts", "tot-deep"]
ON_OFF = {"on": True, "off": False}
SANITY_TOKENS = 16


def sizes(args: argparse.Namespace) -> dict:
    """Every workload's size: the full run's, or --quick's (seconds in all)."""
    if args.quick:
        return dict(document=64, fork_lengths=[32, 64], forks=8, fanout=[(2, 4)], tot=(32, 3, 2, 4), best=(4, 4),
                    mcts=(2, 3, 4, 3), deep=(1, 2, 2))
    expansions = max(1, round(50 * args.mcts_scale))
    return dict(document=512, fork_lengths=[512, 4096], forks=64, fanout=[(8, 16), (32, 16)],
                tot=(256, 5, 4, 24), best=(16, 32), mcts=(expansions, 20, 50, 16),
                deep=(args.tot_deep_questions, 2, args.tot_deep_tokens))


def workloads(chosen: list[str], texts, size: dict) -> list:
    made = []
    for name in chosen:
        if name == "prefill":
            made.append(Prefill(texts, size["document"]))
        elif name == "fork":
            made += [ForkCost(texts, length, size["forks"]) for length in size["fork_lengths"]]
        elif name == "fanout":
            made += [FanOut(texts, size["document"], n, tokens) for n, tokens in size["fanout"]]
        elif name == "tot":
            made.append(TreeOfThought(texts, *size["tot"]))
        elif name == "best16":
            made.append(BestOfN(texts, *size["best"]))
        elif name == "mcts":
            made.append(Mcts(texts, *size["mcts"]))
        elif name == "tot-deep":
            made.append(TreeOfThoughtDeep(texts, *size["deep"]))
    return made


def parse(argv: list[str] | None) -> argparse.Namespace:
    arguments = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the demo model)")
    arguments.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="the engine's dtypes")
    arguments.add_argument("--engine-threads", type=int, nargs="+", default=[torch.get_num_threads()],
                           help=f"torch threads of the engine's variants (default: torch's, here "
                                f"{torch.get_num_threads()})")
    arguments.add_argument("--weights", nargs="+", default=["none"],
                           help="the engine's weight formats, each passed to Engine.from_pretrained as weights= "
                                "(int8, int4; none: the dtype itself, the default)")
    arguments.add_argument("--llama-weights", nargs="+", default=None,
                           help="GGUF files llama.cpp runs: the model's own type and/or copies in "
                                f"{', '.join(COPY_TYPES)} (default: the model's type, f32, bf16, q8_0)")
    arguments.add_argument("--llama-threads", type=int, nargs="+", default=[2, 1])
    arguments.add_argument("--llama-flash-attn", nargs="+", choices=sorted(ON_OFF), default=["off", "on"])
    arguments.add_argument("--llama-kv", nargs="+", choices=["f16", "f32", "q8_0"], default=["f16", "f32"])
    arguments.add_argument("--full-grid", action="store_true", help="every llama.cpp setting combination, not a "
                                                                     "coordinate search")
    arguments.add_argument("--repeats", type=int, default=3, help="runs of each system's fastest variant (median)")
    arguments.add_argument("--mcts-scale", type=float, default=0.1,
                           help="share of the full MCTS (50 expansions, 1,000 rollouts of 50 tokens); default 0.1")
    arguments.add_argument("--tot-deep-questions", type=int, default=2, help=f"1..{len(QUESTIONS)} (default 2)")
    arguments.add_argument("--tot-deep-tokens", type=int, default=32, help="tokens per answer (SGLang: up to 256)")
    arguments.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=WORKLOADS)
    arguments.add_argument("--copies-dir", type=Path, default=None,
                           help="where GGUF copies are written once (default: the dendrite_nb cache's gguf-copies)")
    arguments.add_argument("--quick", action="store_true", help="every workload tiny: a smoke test in seconds")
    arguments.add_argument("--json", type=Path, default=None, help="also write the tables here as JSON")
    args = arguments.parse_args(argv)
    if args.repeats < 1 or args.mcts_scale <= 0 or args.tot_deep_tokens < 1 or min(args.engine_threads) < 1 \
            or min(args.llama_threads) < 1:
        arguments.error("--repeats, --tot-deep-tokens and thread counts must be at least 1, --mcts-scale above 0")
    if not 1 <= args.tot_deep_questions <= len(QUESTIONS):
        arguments.error(f"--tot-deep-questions must be within 1..{len(QUESTIONS)}")
    return args


def load_engines(model: Path, dtypes: list[str], weights: list[str]) -> list[tuple[str, str | None, Engine]]:
    """(label, weights format, engine) for every dtype x --weights value ("none": the dtype itself)."""
    engines = []
    for dtype, kind in itertools.product(dtypes, weights):
        options = {} if kind == "none" else {"weights": kind}
        try:
            engine = Engine.from_pretrained(model, device="cpu", dtype=dtype, **options)
        except (TypeError, ValueError, DendriteError) as error:
            if options and "weights" in str(error):
                raise SystemExit(f"--weights {kind}: the engine refused weights={kind!r} with dtype {dtype} "
                                 f"({type(error).__name__}: {error}). Drop it from --weights (\"none\" runs the "
                                 f"dtype itself).") from None
            raise
        engines.append((dtype if kind == "none" else f"{dtype}, weights {kind}", options.get("weights"), engine))
    return engines


def llama_files(model: Path, checkpoint, asked: list[str] | None, copies: Path) -> dict[str, Path]:
    """Weight-type name -> GGUF file, the model's own type first."""
    own = checkpoint.reader.fields.get("general.file_type")
    own_name = tables.file_type_name(int(own.contents()) if own is not None else None)
    files = {}
    for name in asked or [own_name] + [kind for kind in ("f32", "bf16", "q8_0") if kind != own_name]:
        if name == own_name:
            files[name] = model
        elif name in COPY_TYPES:
            files[name] = gguf_copy(model, name, copies)
            log(f"GGUF copy in {name}: {files[name]}")
        else:
            raise SystemExit(f"--llama-weights {name}: the model is stored as {own_name}, and copies can be written "
                             f"in {', '.join(COPY_TYPES)}; pick from those.")
    return files


def open_engine(engine: Engine, threads: int, workload) -> EngineSystem:
    """The engine, at `threads` torch threads (process-wide: set at each open, and the systems never run at once)."""
    torch.set_num_threads(threads)
    return EngineSystem(engine, f"engine, {threads} torch threads")


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    model = (args.model or demo_model()).resolve()
    setup = Setup(torch.device("cpu"), torch.float32, smoke=False)
    report = Report("llama_cpp_cpu", setup)
    report.note(f"1-minute load average at the start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs; other work on "
                f"the machine slows every figure, and two-thread runs the most)")
    # --quick measures on small buffers: its figures check the script, not the machine.
    report.floors = floors = Floors(measure_copy_bandwidth(setup.device, (32 << 20) if args.quick else None),
                                    measure_matmul_rate(setup.device, torch.float32, 256 if args.quick else None))
    log(f"floors measured here: {floors.describe()}")
    engines = load_engines(model, args.dtypes, args.weights)
    checkpoint = open_gguf(model)
    files = llama_files(model, checkpoint, args.llama_weights, args.copies_dir or default_cache_dir() / "gguf-copies")
    llama_models = {name: LlamaCppModel(path) for name, path in files.items()}
    reference_engine = engines[0][2]
    size = sizes(args)
    texts = make_texts(reference_engine, max(size["document"], size["tot"][0], *size["fork_lengths"]),
                       instructions=max(4, *(n for n, _ in size["fanout"])), moves=size["mcts"][0])
    for line in tables.sanity_lines(reference_engine, engines[0][0], llama_models, texts, SANITY_TOKENS):
        report.note(line)
        log(line)

    engine_variants = [Variant("engine", f"{label}, {threads} thread{'s' if threads > 1 else ''}",
                               tables.engine_weight_bytes(checkpoint, label, kind),
                               functools.partial(open_engine, engine, threads), False)
                       for label, kind, engine in engines for threads in args.engine_threads]
    file_bytes = {name: gguf_costs(checkpoint if path == model else open_gguf(path), stored_bytes).weight_bytes
                  for name, path in files.items()}

    def llama_variant(name: str, setting: LlamaSetting) -> Variant:
        return Variant("llama.cpp", f"{name}, {setting.describe()}", file_bytes[name],
                       lambda workload: LlamaSystem(llama_models[name], name, setting,
                                                    max(workload.cells(), WARM_UP_CELLS),
                                                    max(workload.sequences(), WARM_UP_SEQUENCES)), True)

    knobs = {"threads": args.llama_threads, "flash_attn": [ON_OFF[v] for v in args.llama_flash_attn],
             "kv_type": args.llama_kv}
    costs = gguf_costs(checkpoint, stored_bytes)
    outcomes = []
    threads_before = torch.get_num_threads()
    guard = Guard(attempts=1 if args.quick else 3)   # a smoke run times each run once, whatever else runs
    try:
        for workload in workloads(args.workloads, texts, size):
            outcomes.append(run_workload(workload, texts, engine_variants, list(files), knobs, llama_variant,
                                         args.repeats, args.full_grid, guard, log))
    finally:
        torch.set_num_threads(threads_before)   # the engine's variants set it
    tables.fill(report, outcomes, costs, floors, args.repeats)
    report.note(f"other load: {guard.disturbed} timed runs were disturbed (others used > {guard.busy_cores} of a core "
                f"during them) and redone after a quiet moment; {guard.kept_disturbed} figures kept from disturbed "
                f"runs after {guard.attempts} attempts (the 'others' column: cores others used in each first run)")
    report.note(f"engine: torch {torch.__version__}, {torch.get_num_threads()} threads; llama.cpp: llama-cpp-python "
                f"{tables.llama_version()}; {os.cpu_count()} CPUs; prefix reuse on (the engine's default)")
    report.note("llama.cpp hands a sampled token back at once and feeds it with the next llama_decode (as its "
                "batched examples do); the engine's generate writes each sampled token's KV within its step")
    report.note(f"commit {git_commit()}; command: python benchmarks/llama_cpp_cpu.py {' '.join(argv or sys.argv[1:])}")
    for table in report.tables:
        log()
        log(table.markdown())
    return report.finish(args.json)


if __name__ == "__main__":
    main()
