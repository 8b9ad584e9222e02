"""Sweep the one-row GEMV's tile settings over real projection shapes, and compare it with cuBLAS by rows.

For each weight shape of Qwen3-0.6B and Llama-3.1-8B (bf16, random): cuBLAS (F.linear) and gemv with its
default settings at one row, the five fastest of the settings below, and the two at 1, 2, 4 and 8 rows
(gemv takes at most MAX_ROWS; the model sends it only DISPATCH_ROWS, from these figures). For q/k/v and
gate/up of 0.6B, also the folded variants (the RMSNorm with its residual add in the prologue, the SwiGLU in
the epilogue) next to the separate kernels they replace. Times are CUDA-graph replays with the L2 flushed
(bench_common.kernel_seconds). GPU only.

With --chain-sweep instead: the 0.6B one-row chain of products (28 layers and the LM head, as a decode step
runs them, one CUDA graph; the Chain of docs/lab/probes/probe_persistent_chain.py), each product's settings
timed inside it, the other products at their defaults. There the kernels overlap at their boundaries (PDL),
which single kernels with the L2 flushed do not show.

    python benchmarks/tune_gemv.py [--chain-sweep]
"""
from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from bench_common import graph_seconds, kernel_seconds, log, measure_floors, parser, setup as make_setup
from dendrite_nb.kernels import add_rms_norm, silu_mul

gemv_module = importlib.import_module("dendrite_nb.kernels.gemv")  # the package re-exports the function as `gemv`
SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
          "0.6b lm head": (151936, 1024), "8b qkv": (6144, 4096), "8b down": (4096, 14336)}
SETTINGS = [(block_n, block_k, warps, stages) for block_n in (4, 8, 16, 32, 64) for block_k in (128, 256, 512, 1024)
            for warps in (4, 8) for stages in (2, 3, 4) if block_n * block_k <= 16384]


def chain_sweep(setup, floors) -> None:
    """Each 0.6B product's settings (SETTINGS at 3 stages) timed inside the whole one-row chain."""
    # The chain of gemv launches is the persistent-chain probe's control; the probe lives in the lab now.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "lab" / "probes"))
    from probe_persistent_chain import SHAPE_06B, Chain

    chain = Chain(SHAPE_06B, 28, setup.device, torch.bfloat16, torch.Generator().manual_seed(0))
    floor_ms = chain.weight_bytes / floors.copy_bytes_per_s * 1e3

    def chain_ms(configs) -> float:
        return statistics.median(graph_seconds(chain.launches(configs), setup.device, calls=10, flush_l2=False)
                                 for _ in range(3)) * 1e3
    log(f"0.6B one-row chain of products, 28 layers + LM head ({chain.weight_bytes / 1e9:.2f} GB, floor "
        f"{floor_ms:.3f} ms); each product's settings inside it, the others at their defaults:")
    for name in ("qkv", "o", "gate_up", "down"):
        rows, width = SHAPES[f"0.6b {name}"]
        swiglu = name == "gate_up"
        out_features = rows // 2 if swiglu else rows  # gate/up's output is the intermediate (silu(gate) * up)
        base = chain_ms({})
        timed = sorted((chain_ms({name: setting}), setting) for setting in SETTINGS
                       if setting[3] == 3 and setting[1] <= max(128, 1 << (width - 1).bit_length()))
        log(f"  {name}: default {gemv_module.default_config(out_features, width, swiglu)} {base:.3f} ms "
            f"({base / floor_ms:.2f}x floor); fastest: "
            + "; ".join(f"{setting} {ms:.3f} ({ms / base:.3f})" for ms, setting in timed[:4]))


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--chain-sweep", action="store_true",
                           help="instead: each 0.6B product's settings timed inside the one-row chain")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("tune_gemv times CUDA kernels; run it on a GPU.")
    floors = measure_floors(setup)
    if args.chain_sweep:
        chain_sweep(setup, floors)
        return
    device, dtype = setup.device, torch.bfloat16
    for name, (out_features, width) in SHAPES.items():
        weight = torch.randn(out_features, width, device=device, dtype=dtype) * 0.02
        x = torch.randn(1, width, device=device, dtype=dtype)
        nbytes = out_features * width * 2
        floor_us = nbytes / floors.copy_bytes_per_s * 1e6  # W read once, at the copy's (read + write) rate

        def figure(seconds: float) -> str:
            return f"{seconds * 1e6:.1f} us ({nbytes / seconds / 1e12:.2f} TB/s)"
        cublas = kernel_seconds(lambda: F.linear(x, weight), device)
        default = kernel_seconds(lambda: gemv_module.gemv(x, weight), device)
        swept = sorted((kernel_seconds(lambda: gemv_module.gemv(x, weight, config=setting), device), setting)
                       for setting in SETTINGS if setting[1] <= max(128, 1 << (width - 1).bit_length()))
        log(f"{name} [{out_features} x {width}], {nbytes / 1e6:.1f} MB, read floor {floor_us:.1f} us: cuBLAS "
            f"{figure(cublas)}, gemv default {gemv_module.default_config(out_features, width)} {figure(default)}")
        log("  fastest: " + "; ".join(f"{setting} {figure(seconds)}" for seconds, setting in swept[:5]))
        by_rows = []
        for rows in (1, 2, 4, 8):
            xs = torch.randn(rows, width, device=device, dtype=dtype)
            theirs = kernel_seconds(lambda: F.linear(xs, weight), device)
            ours = (f"{kernel_seconds(lambda: gemv_module.gemv(xs, weight), device) * 1e6:.1f}"
                    if rows <= gemv_module.MAX_ROWS else "-")
            by_rows.append(f"{rows} rows: gemv {ours} / cuBLAS {theirs * 1e6:.1f} us")
        log("  " + "; ".join(by_rows))
        if name in ("0.6b qkv", "0.6b gate_up"):
            residual, norm_weight = torch.randn_like(x), torch.ones(width, device=device, dtype=dtype)
            folded = kernel_seconds(lambda: gemv_module.gemv(x, weight, norm=(residual, norm_weight, 1e-6)), device)
            with_swiglu = kernel_seconds(lambda: gemv_module.gemv(x, weight, norm=(residual, norm_weight, 1e-6),
                                                                  swiglu=True), device)
            norm = kernel_seconds(lambda: add_rms_norm(x, residual, norm_weight, 1e-6), device)
            product = gemv_module.gemv(x, weight)
            swiglu = kernel_seconds(lambda: silu_mul(product), device)
            log(f"  folded: norm + product {folded * 1e6:.1f} us, norm + product + SwiGLU {with_swiglu * 1e6:.1f} us; "
                f"separate: add_rms_norm {norm * 1e6:.1f} us, product {default * 1e6:.1f} us, silu_mul {swiglu * 1e6:.1f} us")


if __name__ == "__main__":
    main()
