"""A decode step split over GPUs (tensor parallelism, issue 43) against the same step on one GPU.

B leaves forked off a P-token prefix (Llama-3.1-8B shape by default, random weights, bf16 on GPUs), 16 tokens each of
their own; a steady step is generate(copies, --steps) / --steps on fresh one-child forks of the leaves, median of
CALLS calls after one untimed call (generate_on_copies). Rows, from one script run on one machine:
  TP=1            the engine on one GPU as a user gets it (CUDA graphs, fused kernels);
  TP=1 eager      the same without CUDA graphs (cuda_graphs=False);
  TP=N            the model split over N GPUs as a user gets it: each rank holds 1/N of the heads, the MLP
                  features and the KV, runs the fused kernels with an all-reduce after each layer's attention
                  and MLP, and replays CUDA graphs with those collectives inside, in lockstep with rank 0;
  TP=N eager      the same without CUDA graphs: every kernel and collective launched from Python;
  llama.cpp       with --llama-gguf, the peer on the same step (peers/workloads.py SteadyDecode: the same prefix,
                  leaves, own tokens and steps; greedy; a unified KV cache whose forks share the prefix's cells),
                  from a GGUF of the same shape written beforehand (random weights of its own, f16), in a worker
                  process of its own: on one GPU (split none), and over every GPU it sees by layers (one GPU
                  works at a time), by rows (every GPU on every layer) and by tensors (weights and KV split as
                  TP; experimental in llama.cpp), each at flash attention on and off, the faster shown. Its
                  step is a call over its llama_decode calls (steps - 1), the engine's a call over its steps
                  (each a forward).
Target (issue 43): at 8B, 64 leaves under 4,096 tokens, TP=2 at most 0.6x the TP=1 step. Floor: the weights read
once per step (every one but the embedding table) + the prefix's KV once + each leaf's own KV, over the copy
bandwidth of one GPU (TP=1) or divided among N GPUs (TP=N: each reads its 1/N share at the same rate at once; the
all-reduces are not counted).

--tree-of-thought: instead, a model too large for one GPU (default Llama-3.1-70B's shape, 141 GB in bf16) split
over --degrees GPUs searches tree_of_thought.py's tree (width 5, depth 10, 32 sampled tokens a level, a 256-token
prompt); its wall time, per decode step, each GPU's peak memory, and the floor of its decode steps.

    python benchmarks/tensor_parallel.py [--shape llama-3.1-8b] [--leaves 64] [--prefix 4096] [--degrees 2]
                                         [--steps 16] [--no-eager] [--llama-gguf PATH] [--llama-splits none layer
                                         row tensor] [--json PATH] [--smoke]
    (cd benchmarks && python -m peers.random_gguf --shape llama-3.1-8b --type f16 --out PATH)   # the GGUF, once
    python benchmarks/tensor_parallel.py --tree-of-thought [--shape llama-3.1-70b] [--degrees 2]
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from bench_common import (Column, Report, free_memory, generate_on_copies, log, measure_floors, model_costs, parser,
                          random_ids, setup as make_setup)
from dendrite_nb import Engine, SamplingParams
from dendrite_nb.model.config import ModelConfig
from dendrite_nb.testing import REAL_SHAPES
from peers.llama_types import SPLIT_MODES, LlamaCppError, LlamaSetting
from peers.llama_worker import LlamaWorker, RemoteSession
from peers.quiet import Guard
from peers.workloads import SteadyDecode, Texts
from tree_of_thought import engine_search

CALLS = 3
OWN = 16
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
TARGET = 0.6
ON_OFF = {True: "on", False: "off"}


def leaves_of(engine: Engine, count: int, prefix_ids: list[int], own_ids: list[list[int]]) -> list:
    root = engine.new_branch("prefix", prefix_ids)
    leaves = engine.fork(root, count)
    engine.append_many(zip(leaves, own_ids))
    return leaves


def step_seconds(engine: Engine, leaves: list, steps: int, device: torch.device) -> float:
    return statistics.median(generate_on_copies(engine, leaves, steps, GREEDY, device, repeats=CALLS)) / steps


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--shape", choices=sorted(REAL_SHAPES), default=None,
                           help="default llama-3.1-8b (llama-3.1-70b with --tree-of-thought)")
    arguments.add_argument("--tree-of-thought", action="store_true",
                           help="search a tree of thought with a model split over --degrees GPUs (no TP=1 row)")
    arguments.add_argument("--leaves", type=int, default=None, help="default 64 (smoke 4)")
    arguments.add_argument("--prefix", type=int, default=None, help="prefix tokens (default 4096; smoke 40)")
    arguments.add_argument("--degrees", type=int, nargs="+", default=[2],
                           help="the split degrees (default 2); TP=1 always runs first, as the baseline")
    arguments.add_argument("--steps", type=int, default=None, help="steps per timed call (default 16; smoke 2)")
    arguments.add_argument("--no-eager", action="store_true", help="leave out the eager rows (minutes on a GPU)")
    arguments.add_argument("--llama-gguf", type=Path, default=None,
                           help="a GGUF of --shape's shape: llama.cpp's rows (the module docstring)")
    arguments.add_argument("--llama-splits", nargs="+", choices=SPLIT_MODES, default=list(SPLIT_MODES),
                           help="llama.cpp's placements (default all; on the CPU only none runs)")
    args = arguments.parse_args(argv)
    args.shape = args.shape or ("llama-3.1-70b" if args.tree_of_thought else "llama-3.1-8b")
    setup = make_setup(args)
    if args.tree_of_thought:
        return tree_of_thought(args, setup)
    leaves_n = args.leaves or (4 if setup.smoke else 64)
    prefix = args.prefix or (40 if setup.smoke else 4096)
    steps = args.steps or (2 if setup.smoke else 16)
    if setup.device.type == "cuda" and max(args.degrees) > torch.cuda.device_count():
        raise SystemExit(f"--degrees {max(args.degrees)} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}.")
    report = Report("tensor_parallel", setup)
    report.floors = floors = measure_floors(setup)
    hf_config = setup.hf_config(args.shape)
    vocab = hf_config["vocab_size"]
    prefix_ids = random_ids(prefix, vocab, seed=1)
    own_ids = random_ids(OWN, vocab, seed=2, rows=leaves_n)
    blocks = -(-prefix // BLOCK_SIZE) + leaves_n * (2 * -(-(OWN + steps) // BLOCK_SIZE) + 2) + 8
    table = report.table(f"decode step, {leaves_n} leaves under {prefix:,} tokens, {setup.shape_name(args.shape)}",
                         [Column("variant", "variant", label=True), Column("step_ms", "step ms", "{:.3f}"),
                          Column("floor_ms", "floor ms", "{:.3f}"), Column("x_floor", "x floor", "{:.2f}"),
                          Column("x_tp1", "x TP=1", "{:.2f}")])
    costs = one_gpu_ms = None
    context = prefix + leaves_n * (OWN + steps / 2)   # the prefix once, each leaf's own tokens mid-call

    def add_row(name: str, gpus: int, seconds: float) -> None:
        """A row beside its floor (each of `gpus` GPUs reads its share of the weights and KV at once) and TP=1."""
        floor = floors.seconds((costs.weight_bytes + costs.kv_bytes(context)) / gpus)
        table.add(variant=name, step_ms=seconds * 1e3, floor_ms=floor * 1e3, x_floor=seconds / floor,
                  x_tp1=seconds * 1e3 / one_gpu_ms)
        log(f"  {name}: {seconds * 1e3:.3f} ms a step (floor {floor * 1e3:.3f})")
    eager = setup.device.type == "cuda" and not args.no_eager
    variants = [("TP=1", 1, {})] + ([("TP=1 eager", 1, {"cuda_graphs": False})] if eager else [])
    for degree in sorted(set(args.degrees) - {1}):
        variants += [(f"TP={degree}", degree, {})]
        if eager:
            variants += [(f"TP={degree} eager", degree, {"cuda_graphs": False})]
    for name, degree, options in variants:
        engine = Engine.from_random(hf_config, device=str(setup.device), dtype=setup.dtype, num_blocks=blocks,
                                    block_size=BLOCK_SIZE, tensor_parallel=degree, **options)
        try:
            if costs is None:   # rank 0 of a split model holds a shard: the whole model's costs come from TP=1
                costs = model_costs(engine.model, engine.kv_dtype)
            leaves = leaves_of(engine, leaves_n, prefix_ids, own_ids)
            seconds = step_seconds(engine, leaves, steps, setup.device)
        finally:
            engine.close()
            free_memory(setup.device)
        one_gpu_ms = one_gpu_ms or seconds * 1e3   # the first row: TP=1 as a user gets it
        add_row(name, degree, seconds)
    if args.llama_gguf is not None:
        for name, gpus, seconds in llama_cpp_steps(args, setup, report, prefix_ids, own_ids, steps):
            add_row(name, gpus, seconds)
    for row in table.rows[1:]:
        if not row["variant"].startswith("TP=") or row["variant"].endswith("eager"):
            continue
        report.note(f"{row['variant']}: {row['x_tp1']:.2f}x the TP=1 step (target <= {TARGET}x "
                    f"at 8B, 64 leaves, 4,096 tokens)")
    return report.finish(args.json)


def llama_cpp_steps(args, setup, report: Report, prefix_ids: list[int], own_ids: list[list[int]],
                    steps: int) -> list[tuple[str, int, float]]:
    """(row name, GPUs it runs on, seconds a step) of llama.cpp at each of --llama-splits that runs here, the
    faster of flash attention on and off (both in the log), the median of CALLS runs after the warm-ups; a
    placement llama.cpp refuses is a note instead."""
    on_gpu = setup.device.type == "cuda"
    gpus = torch.cuda.device_count() if on_gpu else 1
    splits = [split for split in args.llama_splits if split == "none" or (on_gpu and gpus > 1)]
    workload = SteadyDecode(prefix_ids, own_ids, steps)
    texts = Texts(document=prefix_ids, instructions=own_ids, chat_prompt=prefix_ids[:16], moves=[], plan_prompts=[],
                  deep_segments=[])
    guard = Guard(attempts=1) if on_gpu else Guard()   # a GPU machine runs nothing else: its runs are not redone
    threads = min(8, os.cpu_count() or 1)
    rows = []
    for split in splits:
        worker = LlamaWorker(args.llama_gguf.resolve(), -1 if on_gpu else 0, split)
        name = "llama.cpp, 1 GPU" if split == "none" else f"llama.cpp, {split} split over {gpus} GPUs"
        name = name if on_gpu else "llama.cpp, CPU"
        found = {}
        try:
            for flash_attn in (True, False):
                setting = LlamaSetting(threads, flash_attn, "f16")
                try:
                    session = RemoteSession(worker, "f16", setting, workload, texts)
                except LlamaCppError as error:
                    report.note(f"{name}, {setting.describe()}: unavailable: {error}")
                    continue
                try:
                    runs = [session.run(guard, log)[0]["step"] for _ in range(CALLS)]
                finally:
                    session.close()
                found[flash_attn] = statistics.median(runs)
                log(f"  {name}, {setting.describe()}: {found[flash_attn] * 1e3:.3f} ms a step")
        finally:
            worker.close()
        if found:
            best = min(found, key=found.get)
            each = ", ".join(f"{ON_OFF[on]} {seconds * 1e3:.3f} ms" for on, seconds in found.items())
            report.note(f"{name}: flash attention {ON_OFF[best]} was the faster ({each})")
            rows.append((name, 1 if split == "none" else gpus, found[best]))
    return rows


def tree_of_thought(args, setup) -> dict:
    """The search of tree_of_thought.py by a model split over max(--degrees) ranks; one untimed warm-up search."""
    degree = max(args.degrees)
    width, depth, tokens, prompt_len = (3, 2, 4, 16) if setup.smoke else (5, 10, 32, 256)
    report = Report("tensor_parallel", setup)
    report.floors = floors = measure_floors(setup)
    hf_config = setup.hf_config(args.shape)
    config = ModelConfig.from_hf(hf_config)
    blocks = -(-(prompt_len + depth * tokens) // BLOCK_SIZE) + depth * width * (-(-tokens // BLOCK_SIZE) + 1) + 64
    engine = Engine.from_random(hf_config, device=str(setup.device), dtype=setup.dtype, num_blocks=blocks,
                                block_size=BLOCK_SIZE, tensor_parallel=degree)
    try:
        log(f"{setup.shape_name(args.shape)} at tensor_parallel={degree}: {engine.config.describe()}, attention "
            f"{engine.backend.name}")
        prompt_ids = random_ids(prompt_len, config.vocab_size, seed=1)
        engine_search(engine, prompt_ids, width, 1, 2)   # untimed: first launches and compiles
        seconds = engine_search(engine, prompt_ids, width, depth, tokens)
    finally:
        peaks = ([torch.cuda.max_memory_allocated(i) / 2**30 for i in range(torch.cuda.device_count())]
                 if setup.device.type == "cuda" else [])
        engine.close()
    # Each decode step reads every rank's share of the weights and the tree's KV once, all ranks at once.
    weight_bytes = sum(p.numel() for p in _layer_and_head_params(config)) * setup.dtype.itemsize
    mean_context = prompt_len + depth * tokens / 2
    step_floor = floors.seconds((weight_bytes + width * mean_context * config.kv_bytes_per_token *
                                 setup.dtype.itemsize) / degree)
    steps = depth * tokens
    table = report.table(f"tree of thought, width {width}, depth {depth}, {tokens} tokens a level, "
                         f"{setup.shape_name(args.shape)} over {degree} ranks",
                         [Column("system", "system", label=True), Column("s", "wall s", "{:.2f}"),
                          Column("step_ms", "ms a decode step", "{:.1f}"), Column("floor_ms", "step floor ms", "{:.2f}"),
                          Column("x_floor", "x floor", "{:.1f}"), Column("peak_gib", "rank 0 peak GiB", "{:.1f}")])
    table.add(system=f"engine, TP={degree}", s=seconds, step_ms=seconds / steps * 1e3, floor_ms=step_floor * 1e3,
              x_floor=seconds / steps / step_floor, peak_gib=peaks[0] if peaks else None)
    report.note(f"{steps} decode steps of {width} leaves and {depth} forks and prunes; the weights alone are "
                f"{weight_bytes / 1e9:,.1f} GB ({weight_bytes / degree / 1e9:,.1f} GB a rank)")
    return report.finish(args.json)


def _layer_and_head_params(config: ModelConfig) -> list[torch.Tensor]:
    """The parameters a decode step reads (all but the embedding table), as meta tensors: their sizes only."""
    from dendrite_nb.model.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
    embed = model.model.embed_tokens.weight
    return [p for p in {id(p): p for p in model.parameters()}.values()
            if p is not embed or config.tie_word_embeddings]


if __name__ == "__main__":
    main()
