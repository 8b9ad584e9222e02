"""What benchmarks/llama_cpp_cpu.py prints: the start's sanity lines (tokenizers and greedy tokens agree), and the
closing tables (each system's fastest variant per workload against the floors, and every variant's run)."""
from __future__ import annotations

from typing import Any

import torch
from gguf import LlamaFileType

from bench_common import Column, Floors, ModelCosts, Report
from dendrite_nb import Engine

from .llama_cpp_peer import LlamaCppModel, LlamaCppPeer, LlamaSetting
from .report_text import first_difference, seconds_text, tokens_text
from .sweep import Outcome
from .systems import GREEDY
from .workloads import Forward, Texts

ENGINE_BYTES_PER_VALUE = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# Quantized weights (issue 42), 2-D tensors only; their scales are left out, so these floors are a little low.
WEIGHTS_BYTES_PER_VALUE = {"int8": 1.0, "fp8": 1.0, "int4": 0.5}


def file_type_name(file_type: int | None) -> str:
    """general.file_type as --llama-weights names it: MOSTLY_Q4_1 -> q4_1, ALL_F32 -> f32."""
    if file_type is None:
        return "unknown"
    try:
        return LlamaFileType(file_type).name.split("_", 1)[1].lower()
    except ValueError:
        return f"file_type {file_type}"


def engine_weight_bytes(checkpoint: Any, label: str, weights: str | None) -> float:
    """Bytes of the weights one decode step reads as the engine holds them (dtype, or --weights for 2-D tensors)."""
    from serve import gguf_costs   # here: serve.py needs httpx and openai, which a GPU machine may lack

    dtype = label.split(",")[0]
    per_value = ENGINE_BYTES_PER_VALUE.get(dtype, 4.0)
    quantized = WEIGHTS_BYTES_PER_VALUE.get(weights or "", per_value)
    return gguf_costs(checkpoint, lambda t: int(t.n_elements) * (quantized if len(t.shape) >= 2 else per_value)
                      ).weight_bytes


def llama_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def sanity_lines(engine: Engine, label: str, models: dict[str, LlamaCppModel], texts: Texts,
                 tokens: int) -> list[str]:
    """Tokenizers agree on the prompts; llama.cpp's greedy tokens on the chat prompt against the engine's."""
    lines = []
    first = next(iter(models.values()))
    for what, text in (("the document", engine.decode(texts.document)),
                       ("the chat prompt", engine.decode(texts.chat_prompt))):
        ours, theirs = engine.encode(text, at_start=True), first.tokenize(text)
        where = first_difference(ours, theirs)
        lines.append(f"sanity: tokenizers on {what} ({len(ours)} tokens): "
                     + ("the same ids" if where is None else f"DIFFER from token {where} (the workloads feed the "
                                                              f"engine's ids to both)"))
    branch = engine.new_branch("sanity", texts.chat_prompt)
    (ours,) = engine.generate([branch], tokens, GREEDY)
    engine.prune(branch)
    setting = LlamaSetting(threads=torch.get_num_threads(), flash_attn=False, kv_type="f32")
    for name, model in models.items():
        peer = LlamaCppPeer(model, setting, n_ctx=len(texts.chat_prompt) + tokens + 256, n_seq_max=1)
        sequence = peer.new_sequence()
        peer.feed([(sequence, texts.chat_prompt)])
        (theirs,) = peer.generate([sequence], tokens)
        peer.close()
        where = first_difference(ours, theirs)
        lines.append(f"sanity: llama.cpp {name} greedy, {tokens} tokens on the chat prompt: "
                     + (f"equal to the engine's ({label})" if where is None else
                        f"MISMATCH with the engine's ({label}) from token {where}: {theirs} vs {ours}"))
    return lines


def floor_seconds(forwards: list[Forward], weight_bytes: float, costs: ModelCosts, floors: Floors) -> float | None:
    """Each forward: the larger of its weight bytes over the copy bandwidth and its FLOPs over the matmul rate."""
    if not forwards:
        return None
    return sum(floors.seconds(weight_bytes, f.rows * costs.prefill_flops(f.tokens, f.context, heads=1))
               for f in forwards)


def fill(report: Report, outcomes: list[Outcome], costs: ModelCosts, floors: Floors, repeats: int) -> None:
    summary = report.table(
        f"engine and llama.cpp on the CPU, each at its fastest variant per workload (wall time, median of {repeats} "
        "runs; ratio < 1: the engine is faster; floors: weights once per forward / copy bandwidth, or FLOPs / matmul "
        "rate; CPU: the same runs' process CPU seconds, all threads)",
        [Column("workload", "workload", label=True), Column("engine", "engine"),
         Column("engine_variant", "engine variant", label=True), Column("llama", "llama.cpp"),
         Column("llama_variant", "llama.cpp variant", label=True), Column("ratio", "engine / llama.cpp", "{:.2f}"),
         Column("faster", "faster"), Column("engine_floor", "engine floor"),
         Column("llama_floor", "llama.cpp floor"), Column("engine_cpu", "engine CPU"),
         Column("llama_cpu", "llama.cpp CPU"), Column("cpu_ratio", "CPU ratio", "{:.2f}")])
    detail = report.table(
        "every variant's first run, by workload (tokens: against the first engine variant's)",
        [Column("workload", "workload", label=True), Column("variant", "variant", label=True),
         Column("run", "run"), Column("run_cpu", "run CPU"), Column("others", "others", "{:.2f}"),
         Column("median", f"median of {repeats}"), Column("tokens", "tokens")])
    for outcome in outcomes:
        workload, best = outcome.workload, outcome.best
        engine, llama = best["engine"], best["llama.cpp"]
        for metric in workload.metrics:
            engine_s, llama_s = engine.median(metric.key), llama.median(metric.key)
            engine_floor = floor_seconds(metric.forwards, engine.variant.weight_bytes, costs, floors)
            llama_floor = floor_seconds(metric.forwards, llama.variant.weight_bytes, costs, floors)
            ratio = engine_s / llama_s
            engine_cpu, llama_cpu = engine.median(f"{metric.key}_cpu"), llama.median(f"{metric.key}_cpu")
            summary.add(workload=metric.label, engine=seconds_text(engine_s), engine_variant=engine.variant.setting,
                        llama=seconds_text(llama_s), llama_variant=llama.variant.setting, ratio=ratio,
                        faster=f"engine {1 / ratio:.2f}x" if ratio < 1 else f"llama.cpp {ratio:.2f}x",
                        engine_floor=seconds_text(engine_floor), llama_floor=seconds_text(llama_floor),
                        engine_cpu=seconds_text(engine_cpu), llama_cpu=seconds_text(llama_cpu),
                        cpu_ratio=engine_cpu / llama_cpu,
                        engine_s=engine_s, llama_s=llama_s, engine_floor_s=engine_floor, llama_floor_s=llama_floor,
                        engine_cpu_s=engine_cpu, llama_cpu_s=llama_cpu,
                        engine_runs=[r[metric.key] for r in engine.runs],
                        llama_runs=[r[metric.key] for r in llama.runs])
        key = workload.metrics[0].key
        for trial in outcome.trials:
            if trial.unavailable:
                detail.add(workload=workload.metrics[0].label, variant=f"{trial.variant.system} "
                           f"{trial.variant.setting}", unavailable=trial.unavailable)
                continue
            judged = trial is engine or trial is llama
            detail.add(workload=workload.metrics[0].label, variant=f"{trial.variant.system} {trial.variant.setting}",
                       run=seconds_text(trial.runs[0][key]), run_s=trial.runs[0][key],
                       run_cpu=seconds_text(trial.runs[0][f"{key}_cpu"]), run_cpu_s=trial.runs[0][f"{key}_cpu"],
                       others=trial.runs[0]["others_cores"],
                       median=seconds_text(trial.median(key)) if judged else "",
                       tokens=tokens_text(trial, outcome.trials[0]))
        report.note(f"{workload.name}: 1-minute load average {outcome.load[0]:.2f} before, {outcome.load[1]:.2f} after")
