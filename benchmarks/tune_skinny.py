"""Tune the few-row tensor-core product (kernels/skinny.py) and measure what it does to a decoder's chain of
products, against cuBLAS with the norms and the SwiGLU as their own kernels.

1. Each projection shape and the LM head of Qwen3-0.6B and Llama-3.1-8B (bf16, random) at ROWS rows (the
   CUDA-graph bucket of a 5-leaf search step): cuBLAS (F.linear), skinny at its default settings, and the
   fastest settings of a sweep. CUDA-graph replays with the L2 flushed (bench_common.kernel_seconds).
2. The products of every layer of each model (norm + q/k/v, o, norm + gate/up + SwiGLU, down; attention left
   out, o_proj reads the q columns), distinct weights per layer, as one CUDA graph: cuBLAS (and cuBLASLt, which
   decode graphs capture) with the separate norm and SwiGLU kernels, against skinny with the folds (default
   settings and each shape's fastest), and skinny only where it folds (cuBLAS for o and down). Above
   skinny.FOLD_ROWS rows skinny's chains run the norm's own kernel, as the engine does. Floor: the weights'
   bytes over the copy bandwidth measured here.

3. With --chain-sweep MODEL, instead: each product's settings (SETTINGS) timed inside MODEL's whole chain of
   products, one product at a time, the others at their defaults.

    python benchmarks/tune_skinny.py [--rows 8] [--skip-sweep] [--chain-sweep 8b | 8b-tp2]
"""
from __future__ import annotations

import statistics

import torch
from torch.nn import functional as F

from bench_common import graph_seconds, kernel_seconds, log, measure_floors, parser, setup as make_setup
from dendrite_nb.cuda_graphs import GRAPH_BLAS_LIBRARY, blas_library
from dendrite_nb.kernels import add_rms_norm, silu_mul, skinny
from dendrite_nb.kernels.skinny import FOLD_ROWS, default_config

MODELS = {  # hidden, q width, q/k/v rows, intermediate, layers
    "0.6b": (1024, 2048, 4096, 3072, 28),
    "8b": (4096, 4096, 6144, 14336, 32),
    # one rank's shard of 8B at tensor-parallel degree 2 (half the heads, KV heads and intermediate features)
    "8b-tp2": (4096, 2048, 3072, 7168, 32),
}
SETTINGS = ([(block_n, block_k, 4, stages) for block_n in (16, 32, 64) for block_k in (64, 128, 256)
             for stages in (3, 4, 6)] + [(block_n, block_k, 8, 4) for block_n in (64, 128) for block_k in (64, 128)]
            + [(64, 32, 4, 8), (32, 64, 4, 8), (128, 64, 4, 4), (128, 32, 4, 6), (128, 128, 4, 3), (128, 256, 8, 3)])
SPLITS = (1, 2, 3, 4, 6, 8)  # split-K's ways tried on each shape's fastest settings
EPS = 1e-6


def shapes(model: str) -> dict[str, tuple[int, int, bool]]:
    hidden, q_width, qkv_rows, intermediate, _ = MODELS[model]
    return {"qkv": (qkv_rows, hidden, False), "o": (hidden, q_width, False),
            "gate_up": (2 * intermediate, hidden, True), "down": (hidden, intermediate, False)}


LM_HEADS = {"0.6b": (151936, 1024), "8b": (128256, 4096),  # at a search step's rows, outside the graph
            "8b-tp2": (128256, 4096)}   # not split: rank 0 computes the whole head


def sweep(setup, floors, rows: int) -> dict[tuple[str, str], tuple[int, int, int, int]]:
    device, dtype, best = setup.device, torch.bfloat16, {}
    for model in MODELS:
        heads = {"lm_head": (*LM_HEADS[model], False)}
        for name, (out_features, width, swiglu) in {**shapes(model), **heads}.items():
            weight = torch.randn(out_features, width, device=device, dtype=dtype) * 0.02
            x = torch.randn(rows, width, device=device, dtype=dtype)
            norm = (torch.randn_like(x), torch.ones(width, device=device, dtype=dtype), EPS)
            nbytes = out_features * width * 2

            def figure(seconds: float) -> str:
                return f"{seconds * 1e6:.1f} us ({nbytes / seconds / 1e12:.2f} TB/s)"

            def ours(setting=None, splits=None):
                if name in ("qkv", "gate_up") and rows <= FOLD_ROWS:
                    return lambda: skinny(x, weight, norm=norm, swiglu=swiglu, config=setting, splits=splits)
                if name in ("qkv", "gate_up"):  # above FOLD_ROWS the engine runs the norm's own kernel first
                    return lambda: skinny(add_rms_norm(x, norm[0], norm[1], EPS)[0], weight, swiglu=swiglu,
                                          config=setting, splits=splits)
                return lambda: skinny(x, weight, config=setting, splits=splits)

            if swiglu:
                theirs = kernel_seconds(lambda: silu_mul(F.linear(add_rms_norm(x, norm[0], norm[1], EPS)[0], weight)),
                                        device)
            elif name == "qkv":
                theirs = kernel_seconds(lambda: F.linear(add_rms_norm(x, norm[0], norm[1], EPS)[0], weight), device)
            else:
                theirs = kernel_seconds(lambda: F.linear(x, weight), device)
            plain = kernel_seconds(lambda: F.linear(x, weight), device)
            default = kernel_seconds(ours(), device)
            unsplit = kernel_seconds(ours(splits=1), device)
            timed = []
            for setting in SETTINGS:
                if setting[1] > max(16, 1 << (width - 1).bit_length()):
                    continue
                try:
                    timed.append((kernel_seconds(ours(setting), device), setting))
                except Exception as error:  # a setting that does not compile (shared memory): skipped
                    log(f"  {setting}: {type(error).__name__}")
            timed.sort()
            # Split-K's ways for the four fastest settings (the sweep above ran each at its default ways).
            split_timed = sorted((kernel_seconds(ours(setting, ways), device), setting, ways)
                                 for _, setting in timed[:4] for ways in SPLITS)
            best[(model, name)] = timed[0][1]
            folds = {"qkv": "norm + product", "gate_up": "norm + product + SwiGLU"}.get(name, "product")
            chosen = default_config(out_features // (2 if swiglu else 1), width, name in ("qkv", "gate_up"), swiglu,
                                    rows)
            log(f"{model} {name} [{out_features} x {width}] at {rows} rows, {nbytes / 1e6:.1f} MB, floor "
                f"{nbytes / floors.copy_bytes_per_s * 1e6:.1f} us: cuBLAS product {figure(plain)}; {folds}: cuBLAS "
                f"path {figure(theirs)}, skinny default {chosen} "
                f"{figure(default)} (split-K off: {figure(unsplit)})")
            log("  fastest: " + "; ".join(f"{setting} {figure(seconds)}" for seconds, setting in timed[:4]))
            log("  fastest with split-K's ways: " + "; ".join(f"{setting} x{ways} {figure(seconds)}"
                                                          for seconds, setting, ways in split_timed[:4]))
            del weight
    return best


def model_layers(model: str, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Random bf16 weights of every layer of `model`: (q/k/v, o, gate/up, down, norm 1, norm 2) each."""
    hidden, q_width, qkv_rows, intermediate, count = MODELS[model]

    def make(out_features, width):
        return torch.empty(out_features, width, device=device, dtype=torch.bfloat16).normal_(0, 0.02)
    return [(make(qkv_rows, hidden), make(hidden, q_width), make(2 * intermediate, hidden), make(hidden, intermediate),
             1 + 0.1 * torch.randn(hidden, device=device, dtype=torch.bfloat16),
             1 + 0.1 * torch.randn(hidden, device=device, dtype=torch.bfloat16)) for _ in range(count)]


def skinny_chain(layers, x0: torch.Tensor, q_width: int, configs: dict, cublas_unfolded: bool = False,
                 splits: int | None = None, prefetch: int | None = None):
    """A callable running every layer's products through skinny (configs by product name; None: default), with
    the norms folded in up to FOLD_ROWS rows and as their own kernels above, as kernels/products.py runs them."""
    fold = x0.shape[0] <= FOLD_ROWS

    def normed(x, residual, norm_weight, weight, **options):
        if fold:
            return skinny(x, weight, norm=(residual, norm_weight, EPS), **options)
        normed_x, summed = add_rms_norm(x, residual, norm_weight, EPS)
        return skinny(normed_x, weight, **options), summed

    def run():
        x, residual = x0, None
        for qkv, o, gate_up, down, norm1, norm2 in layers:
            h, residual = normed(x, residual, norm1, qkv, config=configs["qkv"], splits=splits, prefetch=prefetch)
            a = h[:, :q_width]
            x = F.linear(a, o) if cublas_unfolded else skinny(a, o, config=configs["o"], splits=splits,
                                                              prefetch=prefetch)
            h, residual = normed(x, residual, norm2, gate_up, swiglu=True, config=configs["gate_up"], splits=splits,
                                 prefetch=prefetch)
            x = F.linear(h, down) if cublas_unfolded else skinny(h, down, config=configs["down"], splits=splits,
                                                                 prefetch=prefetch)
        return x, residual
    return run


def with_graph_blas(fn):
    """fn with torch's products through the BLAS library that decode graphs capture (cuBLASLt)."""
    def run():
        with blas_library(GRAPH_BLAS_LIBRARY):
            return fn()
    return run


def chains(setup, floors, rows: int, best) -> None:
    device, dtype = setup.device, torch.bfloat16
    for model, (hidden, q_width, _, _, count) in MODELS.items():
        layers = model_layers(model, device)
        nbytes = sum(t.numel() * 2 for layer in layers for t in layer[:4])
        x0 = torch.randn(rows, hidden, device=device, dtype=dtype)

        def cublas_chain():
            x, residual = x0, None
            for qkv, o, gate_up, down, norm1, norm2 in layers:
                normed, residual = add_rms_norm(x, residual, norm1, EPS)
                x = F.linear(F.linear(normed, qkv)[:, :q_width], o)
                normed, residual = add_rms_norm(x, residual, norm2, EPS)
                x = F.linear(silu_mul(F.linear(normed, gate_up)), down)
            return x, residual

        defaults = {name: None for name in shapes(model)}
        tuned = {name: best.get((model, name)) for name in shapes(model)}
        floor = nbytes / floors.copy_bytes_per_s
        reference = cublas_chain()
        check = skinny_chain(layers, x0, q_width, tuned)()
        err = ((check[0].float() - reference[0].float()).abs().max() / reference[0].float().abs().max()).item()
        log(f"\n{model}: {count} layers' products at {rows} rows, {nbytes / 1e9:.2f} GB, floor {floor * 1e3:.3f} ms "
            f"(skinny against cuBLAS: max relative difference {err:.2e})")
        variants = {"cuBLAS + separate norm / SwiGLU kernels": cublas_chain,
                    "cuBLASLt + separate norm / SwiGLU kernels": with_graph_blas(cublas_chain),
                    "skinny, folds, default settings": skinny_chain(layers, x0, q_width, defaults),
                    "skinny, folds, default settings, no split-K": skinny_chain(layers, x0, q_width, defaults, splits=1),
                    "skinny, folds, default settings, no prefetch": skinny_chain(layers, x0, q_width, defaults,
                                                                                 prefetch=0),
                    "skinny, folds, fastest settings": skinny_chain(layers, x0, q_width, tuned),
                    "skinny for the folds only, cuBLAS o / down": skinny_chain(layers, x0, q_width, tuned,
                                                                               cublas_unfolded=True)}
        for label, fn in variants.items():
            seconds = graph_seconds(fn, device, calls=3, flush_l2=False)
            log(f"  {label:<45} {seconds * 1e3:.3f} ms = {seconds / floor:.2f}x floor, "
                f"{nbytes / seconds / 1e12:.2f} TB/s")
        del layers
        torch.cuda.empty_cache()


def chain_sweep(setup, floors, rows: int, model: str) -> None:
    """Each product's settings timed inside the whole chain of `model`'s products (one CUDA graph), the other
    products at their defaults: kernels overlap at their boundaries there (PDL), which single-kernel timings
    with the L2 flushed do not see. Each figure is the median of 3 graphs; the defaults' chain runs between."""
    hidden, q_width, _, _, count = MODELS[model]
    layers = model_layers(model, setup.device)
    nbytes = sum(t.numel() * 2 for layer in layers for t in layer[:4])
    floor_ms = nbytes / floors.copy_bytes_per_s * 1e3
    x0 = torch.randn(rows, hidden, device=setup.device, dtype=torch.bfloat16)

    def chain_ms(configs) -> float:
        return statistics.median(graph_seconds(skinny_chain(layers, x0, q_width, configs), setup.device, calls=3,
                                               flush_l2=False) for _ in range(3)) * 1e3
    defaults = {name: None for name in shapes(model)}
    log(f"\n{model}: each product's settings inside the chain of {count} layers' products at {rows} rows "
        f"({nbytes / 1e9:.2f} GB, floor {floor_ms:.3f} ms), the others at their defaults:")
    for name, (out_features, width, swiglu) in shapes(model).items():
        chosen = default_config(out_features // (2 if swiglu else 1), width, name in ("qkv", "gate_up"), swiglu, rows)
        base = chain_ms(defaults)
        timed = []
        for setting in SETTINGS:
            try:
                timed.append((chain_ms({**defaults, name: setting}), setting))
            except Exception as error:  # a setting that does not compile (shared memory): skipped
                log(f"  {name} {setting}: {type(error).__name__}")
        timed.sort()
        log(f"  {name}: default {chosen} {base:.3f} ms ({base / floor_ms:.2f}x floor); fastest: "
            + "; ".join(f"{setting} {ms:.3f} ({ms / base:.3f})" for ms, setting in timed[:4])
            + "; slowest: " + "; ".join(f"{setting} {ms:.3f}" for ms, setting in timed[-2:]))
    del layers
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--rows", type=int, default=8)
    arguments.add_argument("--skip-sweep", action="store_true", help="only the chains, at default settings")
    arguments.add_argument("--chain-sweep", choices=sorted(MODELS), default=None,
                           help="instead: each product's settings timed inside that model's whole chain")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("tune_skinny times CUDA kernels; run it on a GPU.")
    floors = measure_floors(setup, matmul=False)
    if args.chain_sweep:
        chain_sweep(setup, floors, args.rows, args.chain_sweep)
        return
    best = {} if args.skip_sweep else sweep(setup, floors, args.rows)
    log(f"fastest settings: {best}")
    if args.json:
        import json
        with open(args.json, "w") as file:
            json.dump([[model, name, setting] for (model, name), setting in best.items()], file)
    chains(setup, floors, args.rows, best)


if __name__ == "__main__":
    main()
