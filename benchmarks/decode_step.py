"""One decode step against its bandwidth floor, per attention backend, CUDA graphs on and off.

Cases (real shapes, random weights, bf16):
  (a) llama-3.1-8b: 64 leaves forked from a 4,096-token prefix, each given 16 tokens of its own;
      target <= 1.25x floor.
  (b) qwen3-0.6b: 1 leaf with a 512-token context; target <= 2x floor.

A step: the LM head over the leaves' last hidden states, sampling, and the forward that writes the new
tokens' KV. "step ms" is a step inside decoding: the median over CALLS calls of generate(leaves, --steps),
divided by --steps (the engine plans step k+1 while the GPU runs step k, so host work hides there).
"1-step call" is one generate(leaves, 1) call, median of --steps calls: nothing to overlap with, it
pays every host cost in full. Both after --warmup untimed generate(leaves, steps) calls, which also take
the JIT compiles and graph captures. Floor: the bytes a step must read once
(every weight but the embedding table, the shared prefix's KV once, each leaf's own tokens' KV) over
the copy bandwidth measured in the same run, or the step's FLOPs at the measured matmul rate if larger.
Peer in the same run: transformers (LlamaForCausalLM / Qwen3ForCausalLM on the same weight tensors)
decoding one step for the same batch from a pre-filled DynamicCache (the prefix prefilled once and
repeated to the batch, then the leaves' own tokens).

One model per case is built once; each variant is an Engine over it, rebuilt only for its own KV pool.

    python benchmarks/decode_step.py [--cases a b] [--steps 20] [--warmup 1] [--no-hf] [--graphs-only] [--json PATH]
                                     [--kv-dtype fp8] [--weights fp8] [--smoke]

--weights fp8 (int8, int4) runs every variant again after the model's own dtype, over the same weights quantized,
each against its own floor (the quantized bytes).
--kv-dtype fp8 runs the engines over an e4m3 cache (scales included in the floor's bytes); the transformers peer
keeps its bf16 cache.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import torch

from bench_common import (Column, Report, Setup, build_model, engine_variant, fits_in_memory, free_memory, hf_twin,
                          log, measure_floors, model_costs, parser, random_ids, setup as make_setup, time_calls)
from dendrite_nb import SamplingParams
from dendrite_nb.model.quantized_linear import quantize_model

BLOCK_SIZE = 16
CALLS = 3  # timed generate(leaves, steps) calls per variant
# (attention, cuda_graphs): None leaves the engine's default, which is off for the torch reference.
VARIANTS = [("triton", True), ("triton", False), ("flashinfer", True), ("flashinfer", False), ("torch", None)]
# Beside them, the triton engine with graphs held to an earlier kernel choice, as a baseline in the same run: its
# backend's settings. triton-3launch: decode steps keep the three attention launches per layer (RoPE + append,
# attention, merge) where the engine fuses them into one (attention/triton_decode_kernel.py); triton-no-tma:
# every KV tile loads through the block table, also where a run's blocks are consecutive and load through TMA.
BASELINE_ROWS = {"triton-3launch": {"one_tile_programs_per_sm": 0}, "triton-no-tma": {"tma": False}}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
# Errors of a variant that builds but fails while running: reported on its row, the other rows still run.
RUN_ERRORS = (RuntimeError, ValueError, NotImplementedError, AssertionError)


@dataclass(frozen=True)
class Case:
    key: str
    shape: str
    prefix: int  # tokens every leaf shares
    leaves: int  # 1: the prefix's own branch is the leaf
    own: int  # tokens each leaf gets of its own before the measured steps
    target: float  # step / floor

    def describe(self) -> str:
        if self.leaves == 1:
            return f"1 leaf, {self.prefix:,}-token context"
        return f"{self.leaves} leaves off a {self.prefix:,}-token prefix, {self.own} tokens each of their own"


CASES = {"a": Case("a", "llama-3.1-8b", 4096, 64, 16, 1.25),
         "b": Case("b", "qwen3-0.6b", 512, 1, 0, 2.0)}
SMOKE_CASES = {"a": Case("a", "llama-3.1-8b", 64, 4, 4, 1.25),
               "b": Case("b", "qwen3-0.6b", 32, 1, 0, 2.0)}


def num_blocks(case: Case, extra_tokens: int) -> int:
    own_blocks = -(-(case.own + extra_tokens) // BLOCK_SIZE) + 1   # +1: a mid-block fork copies its tail block
    return -(-case.prefix // BLOCK_SIZE) + case.leaves * own_blocks + 8


def engine_step_seconds(model, setup: Setup, attention: str, graphs: bool | None, case: Case, prefix_ids,
                        own_ids, steps: int, warmup: int, backend_settings: dict | None = None,
                        kv_dtype: str | None = None, logprobs: bool = False
                        ) -> tuple[tuple[list[float], list[float]] | None, str | None]:
    """((seconds per step inside generate(leaves, steps), per call), seconds per generate(leaves, 1) call).
    backend_settings: attributes set on the engine's attention backend before its first plan (BASELINE_ROWS).
    logprobs: every generate call keeps its tokens' log-probabilities."""
    engine, reason = engine_variant(model, setup, attention, graphs, block_size=BLOCK_SIZE, kv_dtype=kv_dtype,
                                    num_blocks=num_blocks(case, warmup * steps + CALLS * steps + steps + 1))
    if engine is None:
        return None, reason
    for name, value in (backend_settings or {}).items():
        setattr(engine.backend, name, value)
    try:
        root = engine.new_branch("prefix", prefix_ids)
        leaves = [root]
        if case.leaves > 1:
            leaves = engine.fork(root, case.leaves)
            engine.append_many(zip(leaves, own_ids))
        in_call = time_calls(functools.partial(engine.generate, leaves, steps, GREEDY, logprobs=logprobs),
                             setup.device, CALLS, warmup)
        single = time_calls(functools.partial(engine.generate, leaves, 1, GREEDY, logprobs=logprobs),
                            setup.device, steps)
        return ([t / steps for t in in_call], single), None
    except RUN_ERRORS as error:
        return None, f"failed while running: {type(error).__name__}: {error}"


def hf_step_seconds(model, hf_config, setup: Setup, case: Case, prefix_ids, own_ids, steps: int,
                    warmup: int, cache_bytes: float) -> tuple[list[float] | None, str | None]:
    if not fits_in_memory(setup, 1.5 * cache_bytes):
        return None, f"its DynamicCache needs {cache_bytes / 2**30:.1f} GiB, more than is free here"
    twin = hf_twin(model, hf_config, setup)
    with torch.inference_mode():
        out = twin(input_ids=torch.tensor([prefix_ids], device=setup.device), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        if case.leaves > 1:
            cache.batch_repeat_interleave(case.leaves)   # each leaf its own copy of the prefix, as HF holds it
            out = twin(input_ids=torch.tensor(own_ids, device=setup.device), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)
        state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}   # [leaves, 1]

        def step():
            result = twin(input_ids=state["next"], past_key_values=cache, use_cache=True, logits_to_keep=1)
            state["next"] = result.logits[:, -1].argmax(-1, keepdim=True)

        return time_calls(step, setup.device, steps, warmup), None


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    arguments.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 20; smoke 3)")
    arguments.add_argument("--warmup", type=int, default=None, help="untimed generate(leaves, steps) calls first (default 1)")
    arguments.add_argument("--hf-steps", type=int, default=None, help="timed transformers steps (default 5; smoke 2)")
    arguments.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    arguments.add_argument("--graphs-only", action="store_true",
                           help="only the variants with CUDA graphs (the eager ones take minutes at 8B)")
    arguments.add_argument("--kv-dtype", choices=["fp8"], default=None, help="the engines' KV cache dtype "
                           "(default: the model's, bf16)")
    arguments.add_argument("--weights", choices=["fp8", "int8", "int4"], default=None,
                           help="after the model's own dtype, every variant again over the same weights quantized "
                                "(Engine weights=...), each against its own floor (the quantized bytes)")
    arguments.add_argument("--logprobs", action="store_true",
                           help="the engines keep every sampled token's log-probability (generate(..., logprobs=True))")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    steps = args.steps or (3 if setup.smoke else 20)
    warmup = args.warmup if args.warmup is not None else 1
    hf_steps = args.hf_steps or (2 if setup.smoke else 5)
    report = Report("decode_step", setup)
    report.floors = floors = measure_floors(setup)
    table = report.table("decode step (step: median of {} generate(leaves, {}{}) calls / {}; 1-step call: median of {}; "
                         "floor = bytes read once / copy bandwidth, or FLOPs / matmul rate if larger)"
                         .format(CALLS, steps, ", logprobs=True" if args.logprobs else "", steps, steps),
                         [Column("case", "case", label=True), Column("weights", "weights", label=True),
                          Column("attention", "attention", label=True),
                          Column("graphs", "graphs", label=True), Column("step_ms", "step ms", "{:.3f}"),
                          Column("floor_ms", "floor ms", "{:.3f}"), Column("x_floor", "x floor", "{:.2f}"),
                          Column("target", "target", label=True), Column("vs_hf", "HF / step", "{:.1f}x"),
                          Column("single_ms", "1-step call ms", "{:.3f}")])

    for key in args.cases:
        case = (SMOKE_CASES if setup.smoke else CASES)[key]
        hf_config = setup.hf_config(case.shape)
        case_label = f"({key}) {setup.shape_name(case.shape)}"
        model = build_model(setup, hf_config)
        kv_dtype = torch.float8_e4m3fn if args.kv_dtype else setup.dtype
        costs = model_costs(model, kv_dtype)
        vocab = model.config.vocab_size
        prefix_ids = random_ids(case.prefix, vocab, seed=1)
        own_ids = random_ids(case.own, vocab, seed=2, rows=case.leaves) if case.leaves > 1 else []
        # Own tokens each leaf holds at the median timed step (inside the calls), including the one it writes.
        own_mid = case.own + warmup * steps + (CALLS * steps) // 2 + 1
        context = case.prefix + own_mid
        kv_bytes = costs.kv_bytes(case.prefix + case.leaves * own_mid)
        flops = case.leaves * costs.prefill_flops(1, context - 1)
        floor_s = floors.seconds(costs.weight_bytes + kv_bytes, flops)
        dtype_name = str(setup.dtype).removeprefix("torch.")
        log(f"\n{case_label}, {case.describe()}{', fp8 KV' if args.kv_dtype else ''}: weights "
            f"{costs.weight_bytes / 1e9:.2f} GB + KV read once "
            f"{kv_bytes / 1e9:.3f} GB -> floor {floor_s * 1e3:.3f} ms "
            f"(FLOPs alone {flops / floors.matmul_flop_per_s * 1e3:.3f} ms)")
        target = f"<= {case.target:g}x"

        hf_ms = None
        if args.no_hf:
            hf_reason = "skipped (--no-hf)"
        else:
            cache_bytes = model_costs(model, setup.dtype).kv_bytes(case.leaves * (context + warmup + hf_steps + 2))
            hf_times, hf_reason = hf_step_seconds(model, hf_config, setup, case, prefix_ids, own_ids, hf_steps,
                                                  warmup=2 if not setup.smoke else 1, cache_bytes=cache_bytes)
            free_memory(setup.device)   # the peer's cache, before the engines' pools
            if hf_times is not None:
                hf_ms = statistics.median(hf_times) * 1e3
        for weights in (None, args.weights) if args.weights else (None,):
            if weights is not None:  # the same weights, quantized: its own floor
                quantize_model(model, weights)
                costs = model_costs(model, kv_dtype)
                floor_s = floors.seconds(costs.weight_bytes + kv_bytes, flops)
                log(f"\n{case_label} with {weights} weights: {costs.weight_bytes / 1e9:.2f} GB -> floor "
                    f"{floor_s * 1e3:.3f} ms")
            rows = []
            for attention, graphs in [*VARIANTS, *((label, True) for label in BASELINE_ROWS)]:
                if args.graphs_only and not graphs:
                    continue
                label = {"case": case_label, "weights": weights or dtype_name, "attention": attention,
                         "graphs": {True: "on", False: "off", None: "off"}[graphs], "target": target}
                baseline = BASELINE_ROWS.get(attention)
                measured, reason = engine_step_seconds(model, setup, "triton" if baseline else attention, graphs, case,
                                                       prefix_ids, own_ids, steps, warmup, backend_settings=baseline,
                                                       kv_dtype=args.kv_dtype, logprobs=args.logprobs)
                free_memory(setup.device)   # this variant's pool (and graphs), before the next one's
                if measured is None:
                    log(f"  {attention:>10} graphs {label['graphs']:>3}: unavailable: {reason}")
                    table.add(**label, unavailable=reason)
                    continue
                times, single = measured
                step_ms = statistics.median(times) * 1e3
                row = table.add(**label, step_ms=step_ms, floor_ms=floor_s * 1e3, x_floor=step_ms / (floor_s * 1e3),
                                vs_hf=hf_ms / step_ms if hf_ms else None, min_ms=min(times) * 1e3,
                                single_ms=statistics.median(single) * 1e3)
                rows.append(row)
                log(f"  {attention:>10} graphs {label['graphs']:>3}: {step_ms:8.3f} ms/step ({row['x_floor']:.2f}x floor); "
                    f"1-step call {row['single_ms']:.3f} ms")
            hf_label = {"case": case_label, "weights": dtype_name, "attention": "transformers", "graphs": "off",
                        "target": "peer"}
            if weights is None and hf_ms is None:  # the peer ran once, on the model's own dtype
                table.add(**hf_label, unavailable=hf_reason)
                log(f"  transformers: unavailable: {hf_reason}")
            elif weights is None:
                table.add(**hf_label, step_ms=hf_ms, floor_ms=floor_s * 1e3, x_floor=hf_ms / (floor_s * 1e3), vs_hf=1.0)
                log(f"  transformers (DynamicCache): {hf_ms:8.3f} ms/step")
            if rows:
                best = min(rows, key=lambda r: r["step_ms"])
                verdict = "met" if best["x_floor"] <= case.target else "NOT met"
                report.note(f"({key}) {weights or dtype_name} best: {best['attention']} graphs {best['graphs']}, "
                            f"{best['step_ms']:.3f} ms = {best['x_floor']:.2f}x floor (target {target}: {verdict})"
                            + (f", {hf_ms / best['step_ms']:.1f}x faster than transformers" if hf_ms else ""))
        del model
        free_memory(setup.device)
    return report.finish(args.json)


if __name__ == "__main__":
    main()
