"""Probe: would the 0.6B one-row chain of products run faster if its weights were already in L2?

Decode (b), one leaf of a 0.6B model, is 2.5x its floor, and its 113 one-row GEMVs alone add 0.47 ms against
0.29 ms for their bytes (docs/lab/gpu-decode-step.md). This asks how much of that is HBM and how much is the launches.

- "all layers share layer 0's weights": the same chain reading one layer's 30 MB again and again, so every
  product after the first finds its weights in L2. A bound: no prefetch can do better than this.
- "side-stream prefetch": the real chain, while a second stream of the same CUDA graph brings the weights of
  the next products into L2 (`prefetch.global.L2::evict_last` per 128-byte line, or one
  `cp.async.bulk.prefetch.L2` per 64 KB), `lookahead` products ahead of the one starting (or a layer ahead).
  Each prefetch waits on an event recorded before its product launches, so it cannot run further ahead.
  "events, no prefetch" keeps those events and the side stream's join but prefetches nothing.

Printed beside them: the engine's chain of gemv launches (kernels/gemv.py, PDL) and the floor (the weights'
bytes over the copy bandwidth). GPU only (inline PTX).

    python docs/lab/probes/probe_l2_prefetch.py [--layers 28]
"""
from __future__ import annotations

import sys
from pathlib import Path
import argparse
import statistics

import torch
import triton
import triton.language as tl

# A lab probe (docs/lab/probes/README.md); the benchmark helpers it imports (bench_common and the scripts
# beside it) stay in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_common import graph_seconds  # noqa: E402
from probe_persistent_chain import Chain, real_shape_chain, relative_error  # noqa: E402

LINE_BYTES = 128
BULK_BYTES = 1 << 16


@triton.jit
def _prefetch_lines_kernel(ptr, n_lines, BLOCK: tl.constexpr):
    line = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_lines - 1).to(tl.int64)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [ptr + line * 128], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk_kernel(ptr, n_chunks, last_bytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_chunks - 1)
    nbytes = tl.where(chunk == n_chunks - 1, last_bytes, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptr + chunk.to(tl.int64) * CHUNK, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_into_l2(weight: torch.Tensor, how: str) -> None:
    """Ask for all of weight's bytes in L2 without reading them into registers (fire and forget)."""
    flat = weight.reshape(-1).view(torch.int8)
    if how == "none":   # the side stream's events and joins alone: what the graph's shape costs
        return
    if how == "lines":
        lines = triton.cdiv(flat.numel(), LINE_BYTES)
        _prefetch_lines_kernel[(triton.cdiv(lines, 1024),)](flat, lines, BLOCK=1024, num_warps=4)
    else:
        chunks = triton.cdiv(flat.numel(), BULK_BYTES)
        _prefetch_bulk_kernel[(triton.cdiv(chunks, 128),)](flat, chunks, flat.numel() - (chunks - 1) * BULK_BYTES,
                                                          CHUNK=BULK_BYTES, BLOCK=128, num_warps=4)


def gemv_chain(chain: Chain, shared: bool = False, lookahead: int = 0, how: str = "lines",
               per_layer: bool = False):
    """The engine's chain of gemv launches over chain's weights (layer 0's for every layer when shared), with
    prefetches on a side stream when lookahead > 0 (in products, or in layers when per_layer)."""
    s = chain.shape
    w_gu = chain.w_gu.view(chain.layers, 2 * s["inter"], s["hidden"])
    sources = [0 if shared else layer for layer in range(chain.layers)]
    weights = [w for layer in sources for w in (chain.w_qkv[layer], chain.w_o[layer], w_gu[layer], chain.w_down[layer])]
    step = 4 if per_layer else 1   # products a prefetch covers
    side = torch.cuda.Stream()

    def prefetch(first: int) -> None:
        for index in range(first, min(first + step, len(weights))):
            prefetch_into_l2(weights[index], how)

    def prefetch_ahead(index: int) -> None:
        """The products `lookahead` ahead, on the side stream, once product `index` may start."""
        if index % step:
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        side.wait_event(ready)
        with torch.cuda.stream(side):
            prefetch(index + lookahead * step)

    products = chain.launches(source_layers=sources, before_product=prefetch_ahead if lookahead else None)
    if not lookahead:
        return products

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for first in range(0, lookahead * step, step):
                prefetch(first)
        logits = products()
        main.wait_stream(side)   # a capture must join its side stream
        return logits
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this probe times L2 prefetches on a GPU (inline PTX); there is no CUDA device here")
    device = torch.device("cuda")
    chain, bandwidth, floor_ms, reference = real_shape_chain(args.layers, device)
    l2_mib = torch.cuda.get_device_properties(device).L2_cache_size / 2**20
    print(f"0.6B chain of products, {args.layers} layers + LM head, one row, bf16: {chain.weight_bytes / 1e9:.2f} GB; "
          f"floor {floor_ms:.3f} ms at {bandwidth / 1e12:.2f} TB/s (copy bandwidth); L2 {l2_mib:.0f} MiB")
    variants = {"gemv launches (the engine's)": gemv_chain(chain),
                "all layers share layer 0's weights": gemv_chain(chain, shared=True)}
    for lookahead in (1, 2, 3):
        variants[f"side-stream lines, {lookahead} product(s) ahead"] = gemv_chain(chain, lookahead=lookahead)
    variants["side-stream lines, a layer ahead"] = gemv_chain(chain, lookahead=1, per_layer=True)
    variants["side-stream bulk, 1 product ahead"] = gemv_chain(chain, lookahead=1, how="bulk")
    variants["side-stream events, no prefetch"] = gemv_chain(chain, lookahead=1, how="none")
    for label, run in variants.items():
        # The shared-weight chain computes something else; only the real chains are checked against torch.
        error = "-" if "share" in label else f"{relative_error(run(), reference):.1e}"
        ms = statistics.median([graph_seconds(run, device, calls=10, flush_l2=False) for _ in range(3)]) * 1e3
        print(f"  {label:<40} {ms:7.3f} ms  {ms / floor_ms:5.2f}x floor   rel. error vs float32 {error}")


if __name__ == "__main__":
    main()
