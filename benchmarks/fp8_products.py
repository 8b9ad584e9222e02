"""FP8 weights against bf16 in the model's products, by rows: what reading half the weight bytes buys.

For each projection of Qwen3-0.6B and Llama-3.1-8B (q/k/v, o, gate/up, down, the LM head; random weights) at
1, 4, 16, 64 and 512 rows, three ways, each as the model calls it (the RMSNorm folded into q/k/v and gate/up,
the SwiGLU into gate/up, where the kernel folds them):
- bf16 (base): the bf16 weight through today's products (kernels/products.py, inside graph_products() as a captured
  decode step runs them: gemv at 1 row, skinny at 2-64, cuBLAS beyond);
- fp8: the e4m3 weight and its per-channel scale through the same products (gemv and skinny reading fp8;
  fp8_linear's torch._scaled_mm beyond 64 rows);
- scaled_mm: the library path at every row count, as an eager GPU step runs it: the norm's own kernel,
  torch._scaled_mm with x quantised per row (kernels/fp8_linear.py), the SwiGLU's own kernel.
Each time is a CUDA-graph replay timed with CUDA events, the L2 flushed before each call
(bench_common.kernel_seconds), and is printed in us and in GB/s of the weight's bytes (fp8: its scales too),
next to the copy bandwidth measured here. Every result is first checked against the float32 product of the
dequantised weight. GPU only, except:

    python benchmarks/fp8_products.py [--models 0.6b 8b] [--rows 1 4 16 64 512] [--json out.json]
    python benchmarks/fp8_products.py --sweep [--models 8b] [--rows 64]   # skinny's fp8 settings, wide tiles too
    TRITON_INTERPRET=1 python benchmarks/fp8_products.py --check   # CPU: tiny shapes, interpreted, float32

--check (or bench_common's --smoke) runs every variant on tiny shapes in Triton's interpreter (on the CPU,
float32 activations: the interpreter mishandles bf16) and checks each result, so a CPU test
(tests/benchmarks/test_fp8_products.py) keeps the script working between GPU runs.

Measured on an H200, 2026-11-27 (the working tree on top of 65edf81, bf16 x), fp8 time over bf16's:
- 1 row (gemv): 0.62-0.98x on the 0.6B projections and LM head, 0.29-0.74x on the 8B ones (bf16's own 8B
  q/k/v and gate/up settings are slow at one row: 54 and 113 us);
- 4 to 64 rows (skinny): 0.86-1.44x on the projections, 0.71-0.89x on the LM heads: half the bytes, no gain yet;
- 512 rows: torch._scaled_mm 0.58-0.85x on the 8B gate/up and the LM heads, 1.6-5x elsewhere (x's
  quantisation, about 20 us: kernels/fp8_linear.py).
The fp8 settings (gemv.fp8_config, skinny.default_config(fp8=True)) are the fastest on the whole of a sweep on
the same H200, timed as here, over these ten shapes: 46 gemv settings at one row (BLOCK_N 1-32, BLOCK_K
256-4096, 4 or 8 warps) and 32 skinny settings at 4 and 64 rows (BLOCK_N 32-128, BLOCK_K 128-512, 4 or 8
warps, 3 or 4 stages). fp8 gemv at 2-4 rows lost to skinny except on the 0.6B o_proj and down_proj at 2 and 3
rows (4.0 against 6.4 us at 2 rows), so the products keep gemv for one row.
"""
from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from bench_common import DTYPE_NAMES, Column, Report, Setup, kernel_seconds, log, measure_floors, parser

# (out features, width, fold): "norm" folds the RMSNorm in, "swiglu" the norm and the SwiGLU (gate/up stacked).
MODELS = {
    "0.6b": {"qkv": (4096, 1024, "norm"), "o": (1024, 2048, None), "gate_up": (6144, 1024, "swiglu"),
             "down": (1024, 3072, None), "lm_head": (151936, 1024, None)},
    "8b": {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, None), "gate_up": (28672, 4096, "swiglu"),
           "down": (4096, 14336, None), "lm_head": (128256, 4096, None)},
}
# --check: one tiny model with a product of each kind (the norm folded, the SwiGLU too, neither), widths no block
# divides, at rows that reach each kernel (gemv, skinny with the norm folded and without, the library).
TINY = {"qkv": (96, 72, "norm"), "gate_up": (160, 72, "swiglu"), "o": (72, 80, None)}
CHECK_ROWS = (1, 4, 64, 80)
ROWS = (1, 4, 16, 64, 512)
EPS = 1e-6
# Largest error over the largest reference value: the product's own rounding (float32: 1e-5; bf16 activations:
# 1e-2), and for the library path x's e4m3 quantisation too (2-5% of a row, tests/kernels/test_fp8_weights.py).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
SCALED_MM_TOLERANCE = 0.1
# --sweep: skinny's fp8 settings (BLOCK_N, BLOCK_K, warps, stages), wider tiles of W than the default's 64 rows
# among them. At 64 rows of x a bf16 chunk of x is as large as a 128-row tile of e4m3 W, and every program
# reads all of x's chunks from L2: the fewer programs along N, the less of that traffic per byte of W.
SWEEP_SETTINGS = [(block_n, block_k, warps, stages) for block_n in (64, 128, 256) for block_k in (64, 128)
                  for warps in (4, 8) for stages in (3, 4)]


def make_product(out_features: int, width: int, rows: int, dtype: torch.dtype, device: torch.device,
                 seed: int) -> dict:
    """Random inputs of one product: x, residual, norm weight, the weight in `dtype` and as e4m3 + scales."""
    from dendrite_nb.kv.fp8 import quantize

    generator = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(out_features, width, device=device, generator=generator) * 0.02
    w8, scale = quantize(weight)
    return {"x": torch.randn(rows, width, device=device, generator=generator).to(dtype),
            "residual": torch.randn(rows, width, device=device, generator=generator).to(dtype),
            "norm_weight": (1 + 0.1 * torch.randn(width, device=device, generator=generator)).to(dtype),
            "weight": weight.to(dtype), "w8": w8, "scale": scale}


def model_call(kernels, fold: str | None, inputs: dict, fp8: bool):
    """The product as the model calls it (kernels/products.py), with the weight in x's dtype or the fp8 one."""
    weight, scale = (inputs["w8"], inputs["scale"]) if fp8 else (inputs["weight"], None)
    x, residual, norm_weight = inputs["x"], inputs["residual"], inputs["norm_weight"]
    if fold == "swiglu":
        return lambda: kernels.linear_silu_mul(x, weight, None, (residual, norm_weight, EPS), weight_scale=scale)[0]
    if fold == "norm":
        return lambda: kernels.norm_linear(x, residual, norm_weight, EPS, weight, weight_scale=scale)[0]
    return lambda: kernels.linear(x, weight, weight_scale=scale)


def library_call(kernels, fold: str | None, inputs: dict):
    """The library path at any row count: the norm's kernel, torch._scaled_mm, the SwiGLU's kernel."""
    from dendrite_nb.kernels.fp8_linear import scaled_mm_linear

    x, residual, norm_weight, w8, scale = (inputs[k] for k in ("x", "residual", "norm_weight", "w8", "scale"))

    def run():
        rows = kernels.add_rms_norm(x, residual, norm_weight, EPS)[0] if fold else x
        y = scaled_mm_linear(rows, w8, scale)
        return kernels.silu_mul(y) if fold == "swiglu" else y
    return run


def reference(fold: str | None, inputs: dict, fp8: bool) -> torch.Tensor:
    """The product in float32 (the norm and the SwiGLU too), of the fp8 weight dequantised or of the other."""
    weight = inputs["scale"][:, None] * inputs["w8"].float() if fp8 else inputs["weight"].float()
    x = inputs["x"].float()
    if fold:
        stream = x + inputs["residual"].float()
        x = inputs["norm_weight"].float() * (stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + EPS))
    y = F.linear(x, weight)
    if fold == "swiglu":
        half = y.shape[1] // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    return y


def checked_seconds(fn, expected: torch.Tensor, tolerance: float, what: str, device: torch.device) -> float:
    """Device seconds of one call of fn (CUDA-graph replays timed with events, the L2 flushed), after checking
    its result against `expected`; on the CPU (--check), the checked call's own time, which shows only that
    the variant ran (interpreted)."""
    started = time.perf_counter()
    got = fn()
    elapsed = time.perf_counter() - started
    off = ((got.float() - expected).abs().max() / expected.abs().max()).item()
    if off > tolerance:
        raise SystemExit(f"{what} is {off:.2e} off the float32 reference (tolerance {tolerance}).")
    return kernel_seconds(fn, device) if device.type == "cuda" else elapsed


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--check", action="store_true",
                           help="tiny shapes on the CPU in Triton's interpreter, float32; every result checked")
    arguments.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    arguments.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    arguments.add_argument("--sweep", action="store_true",
                           help="time skinny's fp8 product at SWEEP_SETTINGS and split-K ways (GPU; rows 2-64)")
    args = arguments.parse_args(argv)
    if args.sweep:
        return sweep(args)
    if args.check or args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available() or (args.device or "cuda") == "cpu":
            raise SystemExit("fp8_products times CUDA kernels; run it on a GPU (--check runs tiny shapes on the CPU).")
        device = torch.device(args.device or "cuda")
        dtype = DTYPE_NAMES[args.dtype] if args.dtype else torch.bfloat16
    from dendrite_nb import kernels
    from dendrite_nb.kernels.fp8_linear import has_e4m3
    from dendrite_nb.kernels.products import graph_products

    if device.type == "cpu" and not kernels.INTERPRETED:
        raise SystemExit("--check runs the kernels in Triton's interpreter, which must be on before triton is "
                         "imported: TRITON_INTERPRET=1 python benchmarks/fp8_products.py --check")
    check = device.type == "cpu"
    setup = Setup(device, dtype, smoke=check)
    floors = measure_floors(setup, matmul=False)
    report = Report("fp8_products", setup, floors)
    activations = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    # "base": the weight in the activations' dtype (bf16 on the GPU), as the model holds it unquantised.
    columns = [Column("model", "model", label=True), Column("product", "product", label=True),
               Column("shape", "N x K", label=True), Column("rows", "rows", label=True),
               Column("base_kernel", "kernel"), Column("base_us", f"{activations} us", "{:.1f}"),
               Column("base_gbps", "GB/s", "{:.0f}"), Column("fp8_kernel", "kernel"),
               Column("fp8_us", "fp8 us", "{:.1f}"), Column("fp8_gbps", "GB/s", "{:.0f}"),
               Column("fp8_speedup", f"{activations}/fp8", "{:.2f}"),
               Column("scaled_mm_us", "scaled_mm us", "{:.1f}"), Column("scaled_mm_gbps", "GB/s", "{:.0f}")]
    table = report.table(f"Products by rows: {activations} weights through today's kernels, fp8 through the new "
                         f"ones (inside graph_products()), and torch._scaled_mm; GB/s of the weight's bytes", columns)
    models = {"tiny": TINY} if check else {name: MODELS[name] for name in args.models}
    for model, products in models.items():
        for product, (out_features, width, fold) in products.items():
            for seed, rows in enumerate(CHECK_ROWS if check else args.rows):
                inputs = make_product(out_features, width, rows, dtype, device, seed)
                weight_bytes = out_features * width * inputs["weight"].element_size()
                fp8_bytes = out_features * width + 4 * out_features
                row = {"model": model, "product": product, "shape": f"{out_features} x {width}", "rows": rows}
                what = f"{model} {product} at {rows} rows"
                for name, fp8, nbytes in (("base", False, weight_bytes), ("fp8", True, fp8_bytes)):
                    with graph_products():
                        row[f"{name}_kernel"] = kernels.product_kernel(inputs["x"], inputs["w8" if fp8 else "weight"])
                    # fp8 beyond skinny's rows on a GPU is torch._scaled_mm's product, x quantised to e4m3 too.
                    library = fp8 and row[f"{name}_kernel"] == "cublas" and has_e4m3(device)
                    row[f"{name}_us"] = 1e6 * checked_seconds(
                        in_graph_products(model_call(kernels, fold, inputs, fp8), graph_products),
                        reference(fold, inputs, fp8), SCALED_MM_TOLERANCE if library else TOLERANCE[dtype],
                        f"{what}: the {name} product", device)
                    row[f"{name}_gbps"] = nbytes / row[f"{name}_us"] / 1e3
                row["fp8_speedup"] = row["base_us"] / row["fp8_us"]
                try:
                    row["scaled_mm_us"] = 1e6 * checked_seconds(
                        library_call(kernels, fold, inputs), reference(fold, inputs, True), SCALED_MM_TOLERANCE,
                        f"{what}: torch._scaled_mm", device)
                    row["scaled_mm_gbps"] = fp8_bytes / row["scaled_mm_us"] / 1e3
                except (RuntimeError, NotImplementedError) as missing:  # no _scaled_mm for this device or shape
                    row["scaled_mm_us"] = row["scaled_mm_gbps"] = None
                    report.note(f"scaled_mm unavailable for {what}: {str(missing).splitlines()[0]}")
                table.add(**row)
                log(f"{model} {product} [{out_features} x {width}] {rows} rows: {activations} {row['base_us']:.1f} us, "
                    f"fp8 {row['fp8_us']:.1f} us" + (f", scaled_mm {row['scaled_mm_us']:.1f} us"
                                                     if row["scaled_mm_us"] else ""))
                del inputs
    report.note(f"GB/s: the weight's bytes ({activations}: {torch.finfo(dtype).bits // 8} a weight; fp8: 1 a weight "
                f"and 4 a row's scale) over the time; the norm and SwiGLU folded in, or their own kernels beside "
                f"scaled_mm, count in the time")
    return report.finish(args.json)


def sweep(args) -> dict:
    """Each product of --models at each of --rows (2 to 64, skinny's rows; the norm not folded, as above
    FOLD_ROWS) through skinny over e4m3 weights at every SWEEP_SETTINGS setting, then split-K ways on the best:
    the default's time, the best's, and the bf16 weight's default for scale. Each result is checked first."""
    from dendrite_nb.kernels.skinny import MAX_ROWS, MIN_ROWS, default_config, skinny, stepped_down_configs

    if not torch.cuda.is_available():
        raise SystemExit("--sweep times CUDA kernels: run it on a GPU.")
    device, dtype = torch.device(args.device or "cuda"), torch.bfloat16
    setup = Setup(device, dtype, smoke=False)
    report = Report("fp8_products_sweep", setup, measure_floors(setup, matmul=False))
    table = report.table("skinny over e4m3 weights: default setting against the sweep's best (us, L2 flushed)",
                         [Column("model", "model", label=True), Column("product", "product", label=True),
                          Column("rows", "rows", label=True), Column("bf16_us", "bf16 default us", "{:.1f}"),
                          Column("default_us", "fp8 default us", "{:.1f}"), Column("best_us", "fp8 best us", "{:.1f}"),
                          Column("best", "best (BLOCK_N, BLOCK_K, warps, stages), splits"),
                          Column("best_gbps", "best GB/s", "{:.0f}")])
    for model in args.models:
        for product, (out_features, width, fold) in MODELS[model].items():
            for rows in (r for r in args.rows if MIN_ROWS <= r <= MAX_ROWS):
                inputs = make_product(out_features, width, rows, dtype, device, seed=rows)
                swiglu = fold == "swiglu"

                def call(weight, scale, config=None, splits=None):
                    return lambda: skinny(inputs["x"], weight, swiglu=swiglu, weight_scale=scale, config=config,
                                          splits=splits)
                # No norm folded: above FOLD_ROWS the model normalises x in its own kernel first.
                expected = F.linear(inputs["x"].float(), inputs["scale"][:, None] * inputs["w8"].float())
                if swiglu:
                    half = expected.shape[1] // 2
                    expected = F.silu(expected[:, :half]) * expected[:, half:]
                bf16_us = 1e6 * kernel_seconds(call(inputs["weight"], None), device)
                default = default_config(out_features // (2 if swiglu else 1), width, False, swiglu, rows, True)
                timed = {}
                for config in [default, *SWEEP_SETTINGS]:
                    seconds = checked_seconds(call(inputs["w8"], inputs["scale"], config), expected,
                                              TOLERANCE[dtype], f"{model} {product} {config}", device)
                    # skinny steps a setting down where it needs more shared memory than the GPU has: not this one.
                    if not any(asked == config for asked, _ in stepped_down_configs()):
                        timed[(config, None)] = 1e6 * seconds
                best_config = min((key for key in timed if key[0] != default), key=timed.get)[0]
                for splits in (1, 2, 4, 8):
                    timed[(best_config, splits)] = 1e6 * kernel_seconds(
                        call(inputs["w8"], inputs["scale"], best_config, splits), device)
                best = min(timed, key=timed.get)
                fp8_bytes = out_features * width + 4 * out_features
                table.add(model=model, product=product, rows=rows, bf16_us=bf16_us, default_us=timed[(default, None)],
                          best_us=timed[best], best=f"{best[0]}, {best[1] or 'default'}",
                          best_gbps=fp8_bytes / timed[best] / 1e3)
                log(f"{model} {product} {rows} rows: bf16 {bf16_us:.1f} us, fp8 default {timed[(default, None)]:.1f}, "
                    f"best {timed[best]:.1f} at {best}")
    return report.finish(args.json)


def in_graph_products(fn, graph_products):
    """fn as a captured decode step dispatches it (skinny for 2-64 rows even on a GPU)."""
    def run():
        with graph_products():
            return fn()
    return run


if __name__ == "__main__":
    main()
