"""What the GPU fast-path benchmarks share: arguments, the floors (copy bandwidth, bf16 matmul rate),
timing, engine variants that may be unavailable, the transformers peer, and the closing table.

Every figure is printed next to its floor, measured in the same run: bytes that must move over the
copy bandwidth measured here (read + write bytes of one large device-to-device copy), and where
arithmetic dominates, FLOPs over the measured matmul rate.
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dendrite_nb import Engine
from dendrite_nb.attention import unavailable_reason
from dendrite_nb.config import DTYPES
from dendrite_nb.kv import KVPool
from dendrite_nb.model.config import ModelConfig
from dendrite_nb.model.loader import random_model
from dendrite_nb.model.quantized_linear import QuantizedLinear
from dendrite_nb.model.transformer import CausalLM
from dendrite_nb.testing import REAL_SHAPES, TINY_SHAPES

# Tiny shapes carry no vocabulary (it comes with their tokenizer); smoke runs give them one.
SMOKE_VOCAB = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}
# The tiny shape of the same family that stands in for each real one in smoke runs.
SMOKE_STAND_INS = {"qwen3-0.6b": "qwen3-gqa-tied", "llama-3.2-1b": "llama-mha-tied", "llama-3.1-8b": "llama-gqa-untied",
                   "llama-3.1-70b": "llama-gqa-untied"}
# Errors that mean "this variant cannot be built here" (an unknown option, an unavailable backend, no memory).
UNAVAILABLE_ERRORS = (TypeError, ValueError, NotImplementedError, ImportError, RuntimeError)


# ---- arguments and setup ----------------------------------------------------------------------
DTYPE_NAMES = DTYPES  # --dtype's choices: the engine's own names for weight dtypes


def parser(doc: str) -> argparse.ArgumentParser:
    """The shared options: --device, --dtype, --smoke, --json."""
    result = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--device", default=None,
                        help="default: cuda when available (cpu with --smoke)")
    result.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="weights and KV (default: bfloat16 on cuda, float32 elsewhere)")
    result.add_argument("--smoke", action="store_true",
                        help="tiny shapes (CPU, float32, torch attention unless --device cuda) in seconds: a CI check")
    result.add_argument("--json", type=Path, default=None, help="also write the final table(s) here as JSON")
    return result


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype  # weights and KV
    smoke: bool

    def hf_config(self, shape: str, **overrides: Any) -> dict[str, Any]:
        """The real shape's config.json dict, or in smoke mode the tiny one standing in for it."""
        if self.smoke:
            return TINY_SHAPES[SMOKE_STAND_INS[shape]].hf_config(**{**SMOKE_VOCAB, **overrides})
        return REAL_SHAPES[shape].hf_config(**overrides)

    def shape_name(self, shape: str) -> str:
        return SMOKE_STAND_INS[shape] if self.smoke else shape


def setup(args: argparse.Namespace) -> Setup:
    device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    device = torch.device(device)
    if device.type != "cuda" and not args.smoke and args.device is None:   # asked for by name, a CPU may run them
        raise SystemExit(f"real shapes need a GPU (--device cuda); on {device.type} run with --smoke, or pass "
                         f"--device {device.type} to run them there anyway (slowly).")
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = DTYPE_NAMES[args.dtype] if getattr(args, "dtype", None) else default
    return Setup(device, dtype, args.smoke)


def log(message: str = "") -> None:
    print(message, flush=True)


def machine_line(device: torch.device) -> str:
    versions = [f"torch {torch.__version__}"]
    for package in ("triton", "flashinfer", "transformers"):
        try:
            versions.append(f"{package} {importlib.import_module(package).__version__}")
        except Exception:   # an absent or broken install: the line says so, the benchmark goes on
            versions.append(f"{package} -")
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    return f"{where}; {', '.join(versions)}"


def free_memory(device: torch.device) -> None:
    """Give the device memory of dropped engines and caches back (their tensors may sit in reference cycles)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---- timing -----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `repeats` calls of fn (device synchronised around each), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return times


def generate_on_copies(engine, leaves, steps: int, sampling, device: torch.device, repeats: int,
                       warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` generate(copies, steps) calls, each on fresh one-child forks of `leaves`
    (pruned after), after `warmup` such calls untimed. Every call decodes the same tree shapes from the same
    context lengths, so the CUDA graphs the warm-up captures serve the timed calls: the figure is a steady step.
    Calling generate on the leaves themselves would grow their contexts from call to call, and each new plan
    shape costs a capture (about three eager forwards) inside a timed call."""
    times = []
    for call in range(warmup + repeats):
        copies = [engine.fork(leaf, 1)[0] for leaf in leaves]
        sync(device)
        started = time.perf_counter()
        engine.generate(copies, steps, sampling)
        sync(device)
        if call >= warmup:
            times.append(time.perf_counter() - started)
        engine.prune(copies)
    return times


def per_replay_seconds(run, replays: int, rounds: int = 5) -> float:
    """Median over rounds of (device time of `replays` back-to-back calls of run) / replays."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / replays)
    return statistics.median(times)


def busy_chain_us(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """(start us, end us, name) of a GPU's kernels -> the time each name adds to the union of their intervals.
    Under PDL a kernel starts while the one before it runs and waits inside, so kernels' own times overlap and do
    not add up to the busy time. Walking the kernels in order of their end, each is charged only the time by which
    it moves the end of everything before it: these figures sum to the busy time and show the chain a step waits on."""
    charged: dict[str, float] = {}
    end = float("-inf")
    for start, stop, name in sorted(spans, key=lambda span: (span[1], span[0], span[2])):
        if stop > end:
            charged[name] = charged.get(name, 0.0) + stop - max(start, end)
            end = stop
    return charged


def kernel_seconds(fn: Callable[[], Any], device: torch.device, capture: bool = True) -> float:
    """Median device seconds of one call of fn (GPU launches), with the L2 cache flushed before each call so
    its inputs come from memory as in a real step. On CUDA the calls replay from a CUDA graph, so the
    figure is GPU time, not Python launch overhead (a few tens of us per Triton launch); where fn cannot
    be captured (or capture=False), triton's do_bench (which includes that overhead); on the CPU,
    synchronised calls."""
    if device.type == "cuda":
        if capture:
            try:
                return graph_seconds(fn, device)
            except RuntimeError as error:   # not capturable (it syncs, or plans inside): time it launch by launch
                log(f"  (not capturable in a CUDA graph, timed with do_bench: {str(error).splitlines()[0][:100]})")
                free_memory(device)
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return statistics.median(time_calls(fn, device, repeats=10, warmup=2))


L2_FLUSH_BYTES = 256 * 2**20  # larger than any GPU's L2 here (H200: 60 MB)
GRAPH_CALLS = 20


def graph_seconds(fn: Callable[[], Any], device: torch.device, calls: int = GRAPH_CALLS,
                  flush_l2: bool = True) -> float:
    """Device seconds per call of fn: a CUDA graph of `calls` x (L2 flush, fn) minus one of the flushes alone.
    flush_l2=False: a graph of `calls` x fn alone (for work whose bytes dwarf the L2 anyway)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None
    fn()   # compiles and allocates outside the capture
    torch.cuda.synchronize(device)

    def replay_seconds(with_fn: bool) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if flush is not None:
                    flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        times = []
        for _ in range(5):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        return statistics.median(times)

    flush_seconds = replay_seconds(False) if flush_l2 else 0.0
    return max(replay_seconds(True) - flush_seconds, 0.0) / calls


# ---- floors -----------------------------------------------------------------------------------
def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of one large device-to-device copy, counting the bytes read and the bytes written."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (512 << 20))   # a CPU's caches hold less
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(time_calls(functools.partial(dst.copy_, src), device, repeats=10, warmup=2))
    del src, dst
    free_memory(device)
    return 2 * nbytes / seconds


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int | None = None) -> float:
    """FLOP/s of a large square n x n matmul in `dtype` on random data (default n: 8,192 on CUDA, 1,024 elsewhere)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = statistics.median(time_calls(functools.partial(torch.matmul, a, b), device, repeats=10, warmup=3))
    del a, b
    free_memory(device)
    return 2 * n ** 3 / seconds


@dataclass(frozen=True)
class Floors:
    copy_bytes_per_s: float  # read + write bytes of a device-to-device copy
    matmul_flop_per_s: float | None

    def seconds(self, nbytes: float, flops: float = 0.0) -> float:
        """The roofline floor: the larger of the bytes' time and the FLOPs' time."""
        flop_s = flops / self.matmul_flop_per_s if self.matmul_flop_per_s else 0.0
        return max(nbytes / self.copy_bytes_per_s, flop_s)

    def describe(self) -> str:
        text = f"copy bandwidth {self.copy_bytes_per_s / 1e9:,.0f} GB/s (read + write)"
        if self.matmul_flop_per_s:
            rate = self.matmul_flop_per_s
            text += f", matmul {rate / 1e12:,.0f} TFLOP/s" if rate >= 1e12 else f", matmul {rate / 1e9:,.1f} GFLOP/s"
        return text

    def as_json(self) -> dict[str, Any]:
        return {"copy_bytes_per_s": self.copy_bytes_per_s, "matmul_flop_per_s": self.matmul_flop_per_s}


def measure_floors(setup: Setup, matmul: bool = True) -> Floors:
    small = setup.smoke and setup.device.type != "cuda"   # a smoke run checks the script: small and quick
    floors = Floors(measure_copy_bandwidth(setup.device, (32 << 20) if small else None),
                    measure_matmul_rate(setup.device, setup.dtype, 256 if small else None) if matmul else None)
    log(f"floors measured here: {floors.describe()}")
    return floors


@dataclass(frozen=True)
class ModelCosts:
    """What one forward of a model must move and compute, from its parameters."""

    weight_bytes: int  # read by every forward: the layers, the final norm and the LM head (not the embedding table)
    layer_params: int  # multiply-adds per token in the layers
    head_params: int  # multiply-adds per LM-head row
    kv_bytes_per_token: int
    attention_flops_per_pair: int  # per (query, context token) pair over all layers: q.k and p.v

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token

    def prefill_flops(self, new_tokens: int, context: int, heads: int = 1) -> float:
        """FLOPs to prefill `new_tokens` after `context` cached tokens and take `heads` LM-head rows."""
        pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2
        return 2 * (new_tokens * self.layer_params + heads * self.head_params) + pairs * self.attention_flops_per_pair


def model_costs(model: CausalLM, kv_dtype: torch.dtype) -> ModelCosts:
    """Bytes and sizes a step's floor counts. Quantized weights (model/quantized_linear.py) count their own bytes
    (integers and scales): a quantized LM head is a copy, so then even a tied embedding table is only indexed."""
    config = model.config
    embed = model.model.embed_tokens.weight
    unique = {id(p): p for p in model.parameters()}.values()
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    head_is_table = config.tie_word_embeddings and not isinstance(model.lm_head, QuantizedLinear)
    # An untied embedding table is only indexed (B rows); a tied one is read whole as the LM head.
    weight_bytes = sum(p.numel() * p.element_size() for p in unique if p is not embed or head_is_table)
    weight_bytes += sum(m.weight_bytes() for m in quantized)
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    layer_params += sum(m.in_features * m.out_features for m in model.model.layers.modules()
                        if isinstance(m, QuantizedLinear))
    return ModelCosts(
        weight_bytes=weight_bytes,
        layer_params=layer_params,
        head_params=config.vocab_size * config.hidden_size,
        kv_bytes_per_token=KVPool.block_bytes(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                                              head_dim=config.head_dim, block_size=1, dtype=kv_dtype),  # fp8: + scales
        attention_flops_per_pair=4 * config.num_layers * config.num_heads * config.head_dim,
    )


# ---- engines and peers ------------------------------------------------------------------------
def build_model(setup: Setup, hf_config: dict[str, Any], seed: int = 0) -> CausalLM:
    """Random weights of the shape, built once and shared by every engine variant and the HF peer."""
    return random_model(ModelConfig.from_hf(hf_config), setup.device, setup.dtype, seed)


def engine_variant(model: CausalLM, setup: Setup, attention: str, cuda_graphs: bool | None,
                   **options: Any) -> tuple[Engine | None, str | None]:
    """(engine, None) over the shared model, or (None, why it cannot run here). cuda_graphs None: the
    engine's default (the option is not passed)."""
    if setup.smoke and setup.device.type == "cpu":
        # Triton's CPU interpreter (TRITON_INTERPRET=1, as the test suite sets) would take minutes here.
        if attention not in ("torch", "auto"):
            return None, "not run in a CPU smoke run (the torch reference only)"
        attention = "torch"
    if attention != "auto":   # auto picks one that can run
        reason = unavailable_reason(attention, setup.device, setup.dtype, model.config.head_dim)
        if reason is not None:
            return None, reason
    if cuda_graphs is not None:
        options["cuda_graphs"] = cuda_graphs
    try:
        return Engine(model, None, device=setup.device, attention=attention, **options), None
    except UNAVAILABLE_ERRORS as error:
        free_memory(setup.device)
        return None, f"{type(error).__name__}: {error}"


def hf_twin(model: CausalLM, hf_config: dict[str, Any], setup: Setup):
    """The transformers model of the same config, holding the engine model's own weight tensors (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(setup.device):
        twin = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config), dtype=setup.dtype)
    result = twin.load_state_dict(model.state_dict(), strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"transformers' {type(twin).__name__} and the engine model name their weights "
                           f"differently: missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
    free_memory(setup.device)   # the twin's own random weights, replaced above
    return twin.eval()


def random_ids(count: int, vocab_size: int, seed: int, rows: int | None = None) -> list[int] | list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (count,) if rows is None else (rows, count)
    return torch.randint(3, vocab_size, shape, generator=generator).tolist()


def fits_in_memory(setup: Setup, nbytes: float, headroom: float = 0.9) -> bool:
    if setup.device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(setup.device)
    return nbytes < headroom * free


# ---- output -----------------------------------------------------------------------------------
@dataclass
class Column:
    key: str
    header: str
    fmt: str = "{}"  # applied to numbers; strings print as they are
    label: bool = False  # printed for an unavailable row too


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, **values: Any) -> dict[str, Any]:
        """A row; one with `unavailable` (the reason) prints its label columns and the reason."""
        self.rows.append(values)
        return values

    def render(self) -> str:
        cells = [[c.header for c in self.columns]]
        for row in self.rows:
            cells.append([_cell(row.get(c.key), c.fmt) if (c.label or "unavailable" not in row) else ""
                          for c in self.columns])
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title]
        for row, line in zip([None, *self.rows], cells):
            text = "  ".join(cell.rjust(width) for cell, width in zip(line, widths))
            if row is not None and "unavailable" in row:
                labels = "  ".join(cell.rjust(w) for cell, w, c in zip(line, widths, self.columns) if c.label)
                text = f"{labels}  unavailable: {row['unavailable']}"
            lines.append(text.rstrip())
        return "\n".join(lines)

    def markdown(self) -> str:
        """The table as markdown (for REPORT.md); an unavailable row puts its reason after its labels."""
        lines = [f"| {' | '.join(c.header for c in self.columns)} |", f"|{'---|' * len(self.columns)}"]
        for row in self.rows:
            if "unavailable" in row:
                labels = [_cell(row.get(c.key), c.fmt) for c in self.columns if c.label]
                cells = labels + [f"unavailable: {row['unavailable']}"] + [""] * (len(self.columns) - len(labels) - 1)
            else:
                cells = [_cell(row.get(c.key), c.fmt) for c in self.columns]
            lines.append(f"| {' | '.join(cells)} |")
        return "\n".join(lines)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return value if isinstance(value, str) else fmt.format(value)


class Report:
    """Collects the closing tables and verdict lines, prints them last with the wall time, writes JSON."""

    def __init__(self, script: str, setup: Setup, floors: Floors | None = None):
        self.started = time.perf_counter()
        self.script, self.setup, self.floors = script, setup, floors
        self.tables: list[Table] = []
        self.notes: list[str] = []
        self.machine = machine_line(setup.device)
        log(f"{script}: {self.machine}; device {setup.device}, {str(setup.dtype).removeprefix('torch.')}"
            f"{' (smoke: tiny shapes)' if setup.smoke else ''}")

    def table(self, title: str, columns: list[Column]) -> Table:
        self.tables.append(Table(title, columns))
        return self.tables[-1]

    def note(self, line: str) -> None:
        self.notes.append(line)

    def finish(self, json_path: Path | None) -> dict[str, Any]:
        wall_s = time.perf_counter() - self.started
        log()
        for table in self.tables:
            log(table.render())
            log()
        if self.setup.smoke:
            self.notes.append("smoke run: tiny shapes, so these figures check the script, not the engine's speed; "
                              "the targets are for real shapes on the GPU")
        for line in self.notes:
            log(line)
        if self.floors is not None:
            log(f"floors: {self.floors.describe()}")
        log(f"{self.script} wall time: {wall_s:.1f} s")
        payload = {
            "script": self.script, "machine": self.machine, "device": str(self.setup.device),
            "dtype": str(self.setup.dtype).removeprefix("torch."), "smoke": self.setup.smoke, "wall_s": wall_s,
            "floors": self.floors.as_json() if self.floors else None, "notes": self.notes,
            "tables": [{"title": t.title, "rows": t.rows} for t in self.tables],
        }
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(payload, indent=1, default=str))
        return payload
