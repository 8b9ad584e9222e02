"""The host's own work per decode step, on any machine: the engine's bookkeeping with the model taken out.

A decode step is planned on the host while the GPU runs the step before it, so the host's bookkeeping is
hidden only while it takes less time than the GPU's step. Here `generate` runs with the model's forward
and its LM head replaced by nothing (zero hidden states, zero logits): what is timed is every other thing
a step does on the host. That is each leaf's append, its block table, the KV segments, the Triton
attention plan (planned for an H200's 132 multiprocessors, as on the GPU), greedy sampling on the CPU,
and the tokens' bookkeeping.

Rows: N leaves forked off one shared prefix (a search's step), each with 16 tokens of its own.
- "mean step" is what a generation pays, Python's garbage collections included;
- "median call" is the median of the calls' per-step times, which a rare collection does not move;
- "full GCs" counts the oldest-generation collections over all timed steps. With torch and transformers
  imported, the collector tracks about 400,000 objects, and a full collection walks all of them.
Peer in the same run: the same steps with the heap frozen first (gc.freeze() before the timed calls,
gc.unfreeze() after), so that collections walk only what the steps make: what the collector costs.
Beside them, for scale, the GPU floor of the same step on the real shape: weight bytes + KV bytes over
4.1 TB/s (an H200's copy bandwidth, measured by the GPU benchmarks), or the products' FLOPs over 750
TFLOP/s where more. It is computed here, not measured: the host keeps up with the GPU only while its step
is under the GPU's.

    python benchmarks/host_step.py [--leaves 1 64 1000] [--prefix 2048] [--smoke]
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend plans on the host; no kernel runs here

import torch  # noqa: E402

from bench_common import log, parser  # noqa: E402
from dendrite_nb import Engine, SamplingParams  # noqa: E402
from dendrite_nb.testing import REAL_SHAPES  # noqa: E402
from dendrite_nb.testing.checkpoints import write_tiny_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
H200_SMS = 132
H200_COPY_BYTES_PER_S = 4.1e12
H200_MATMUL_FLOP_PER_S = 7.5e14  # bf16, dense: 726-807 TFLOP/s measured by the GPU benchmarks
OWN_TOKENS = 16
REAL_SHAPE = "qwen3-0.6b"  # the model the floors are computed for


def gpu_floor_ms(leaves: int, prefix: int) -> float:
    """Weights + the prefix's KV once + each leaf's own KV over an H200's copy bandwidth (bf16), or the
    products' FLOPs (2 per weight per row) over its matmul rate where more (many rows)."""
    config = REAL_SHAPES[REAL_SHAPE].hf_config()
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    inter, heads, kv_heads = config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (heads * 2 + kv_heads * 2) + 3 * hidden * inter
    weights = 2 * (layers * per_layer + vocab * hidden)
    kv_per_token = 2 * 2 * layers * kv_heads * head_dim
    bytes_s = (weights + kv_per_token * (prefix + leaves * OWN_TOKENS)) / H200_COPY_BYTES_PER_S
    return max(bytes_s, weights * leaves / H200_MATMUL_FLOP_PER_S) * 1e3  # weights bytes = params x 2


def stub_model(engine: Engine) -> None:
    """The forward and the LM head replaced by zeros of their shapes: only the host's work is left."""
    config = engine.model.config
    width = 8192  # rows of the largest forward (a prefill) that runs
    hidden = torch.zeros(width, config.hidden_size)
    logits = torch.zeros(width, config.vocab_size)
    runner = engine._runner

    def run(planned, token_ids):
        rows_hidden = hidden[: len(planned.records)]
        rows = list(rows_hidden)
        for record, row in zip(planned.records, rows):
            record.node.last_hidden = row
        runner.last_hidden, runner.last_rows = rows_hidden, rows
    runner.run = run
    engine.model.logits = lambda rows_hidden: logits[: len(rows_hidden)]


def time_steps(engine: Engine, leaves, calls: int, steps: int, frozen_heap: bool) -> tuple[float, float, int]:
    """(mean seconds per step, median call's seconds per step, full collections) over `calls` generate calls."""
    full = [0]

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full[0] += 1
    engine.generate(leaves, 2, GREEDY)  # untimed
    gc.callbacks.append(count)
    if frozen_heap:
        gc.collect()
        gc.freeze()
    try:
        per_call = []
        for _ in range(calls):
            started = time.perf_counter()
            engine.generate(leaves, steps, GREEDY)
            per_call.append((time.perf_counter() - started) / steps)
    finally:
        gc.callbacks.remove(count)
        if frozen_heap:
            gc.unfreeze()
    return statistics.mean(per_call), statistics.median(per_call), full[0]


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--leaves", type=int, nargs="+", default=None, help="default 1 64 1000 (smoke: 1 8)")
    arguments.add_argument("--prefix", type=int, default=None, help="shared tokens (default 2048; smoke 64)")
    arguments.add_argument("--calls", type=int, default=None, help="generate calls per row (default 6; smoke 2)")
    arguments.add_argument("--steps", type=int, default=16, help="steps per call")
    args = arguments.parse_args(argv)
    leaves_list = args.leaves or ([1, 8] if args.smoke else [1, 64, 1000])
    prefix = args.prefix or (64 if args.smoke else 2048)
    calls = args.calls or (2 if args.smoke else 6)
    log(f"host bookkeeping per decode step (model stubbed out), {prefix:,}-token prefix, {OWN_TOKENS} own tokens "
        f"per leaf; CPU: {os.cpu_count()} cores, torch {torch.__version__}")
    log(f"{'leaves':>7} {'GC':>14} {'mean step ms':>13} {'median call ms':>15} {'full GCs':>9} "
        f"{'us per leaf':>12} {'GPU floor ms (0.6B, computed)':>30}")
    with tempfile.TemporaryDirectory() as folder:
        write_tiny_checkpoint(Path(folder), max_position_embeddings=prefix + 64 + 2 * calls * args.steps + 64)
        for leaves in leaves_list:
            room = -(-(OWN_TOKENS + 2 * (calls + 1) * args.steps + 16) // 16) + 1
            engine = Engine.from_pretrained(folder, device="cpu", attention="triton", block_size=16,
                                            num_blocks=prefix // 16 + 2 * leaves * room + 16)
            engine.backend.multiprocessors = H200_SMS
            stub_model(engine)
            root = engine.new_branch("prefix", [3 + i % 200 for i in range(prefix)])
            kids = [root] if leaves == 1 else engine.fork(root, leaves)
            engine.append_many([(kid, [5] * OWN_TOKENS) for kid in kids])
            for frozen_heap, label in ((False, "collector on"), (True, "heap frozen")):
                mean_s, median_s, full = time_steps(engine, kids, calls, args.steps, frozen_heap)
                log(f"{leaves:>7} {label:>14} {mean_s * 1e3:13.3f} {median_s * 1e3:15.3f} {full:>9} "
                    f"{mean_s / leaves * 1e6:12.2f} {gpu_floor_ms(leaves, prefix):30.3f}")
            engine.close()


if __name__ == "__main__":
    main()
