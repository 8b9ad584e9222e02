"""Probe: would one persistent kernel run a one-row decode step's chain of products faster than 113 launches?

Decode (b), one leaf of a 0.6B model, is 2.5x its floor; its 113 one-row GEMVs alone add 0.46 ms to the step
against 0.29 ms for their bytes (docs/lab/gpu-decode-step.md). Each of them is a kernel: it waits for the one before
it to finish, loads x, and only the first chunks of its W were loaded before that wait (PDL, kernels/pdl.py).

Here the same chain runs as ONE kernel of a few programs per multiprocessor, all resident at once. Each phase
(q/k/v with the norm folded in, o with the residual, gate/up with the norm and the SwiGLU, down with the
residual; then the LM head) gives each program one tile of W's rows with all of K. A program loads its next
tile of W into registers BEFORE it waits at the barrier that ends the phase, so every phase's weights stream
while the previous phase finishes. The barrier is a counter in global memory: each program adds 1 when its
tile is stored, and spins until all have. No attention runs here: o reads the first rows of q/k/v's output.

Printed beside it in the same run: the engine's chain of gemv launches (kernels/gemv.py, PDL) over the same
weights, and the floor (the weights' bytes over the copy bandwidth). Both are CUDA graphs of whole chains.

    python docs/lab/probes/probe_persistent_chain.py [--layers 28] [--programs-per-sm 2]

A probe, not an engine path: its result is in docs/lab/gpu-decode-step.md. With TRITON_INTERPRET=1 (one
program, tiny shapes) it checks the kernel against torch on the CPU.
"""
from __future__ import annotations

import sys
from pathlib import Path
import argparse
import statistics
from typing import Callable

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

# A lab probe (docs/lab/probes/README.md); the benchmark helpers it imports (bench_common and the scripts
# beside it) stay in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

EPS = 1e-6
# Qwen3-0.6B: hidden 1024, 16 q + 8 kv heads of 128, intermediate 3072, vocab 151,936.
SHAPE_06B = dict(hidden=1024, qkv=4096, attn=2048, inter=3072, vocab=151936)
TINY = dict(hidden=64, qkv=192, attn=128, inter=96, vocab=512)


@triton.jit
def _load_acquire(ptr):
    """The counter, read at GPU scope with acquire: every thread's later reads are ordered after it."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _arrive_and_wait(bar_ptr, target, WAIT: tl.constexpr):
    """The end of a phase: this program's stores are published (release), then it waits for every program.
    WAIT 1: polls the counter with acquire atomics; 2: with acquire loads (each thread polls: an atomic is made
    by one thread of the program); 0: no wait at all (a timing bound only: the results are wrong)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    spins = 0  # a wait gives up after 4M polls: wrong results, not a hung GPU, were programs ever not all resident
    if WAIT == 1:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while (seen < target) & (spins < 4194304):
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
    elif WAIT == 2:
        seen = _load_acquire(bar_ptr)
        while (seen < target) & (spins < 4194304):
            seen = _load_acquire(bar_ptr)
            spins += 1


@triton.jit
def _row_tile(w_ptr, tile, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [tile * BLOCK_N, +BLOCK_N) of W [N, K] with all of K, as [BLOCK_N, BLOCK_K] (0 past the edges)."""
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                   other=0.0)


@triton.jit
def _vector(ptr, K, BLOCK_K: tl.constexpr):
    """An activation written by other programs in the last phase: read from L2 (.cg), never a stale L1 line."""
    k = tl.arange(0, BLOCK_K)
    return tl.load(ptr + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _store_rows(ptr, tile, values, N, BLOCK_N: tl.constexpr):
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(ptr + n, values, mask=n < N)


@triton.jit
def _normed(ptr, nw_ptr, K, eps, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """nw * rmsnorm(v) of the activation at ptr, rounded to dtype as the engine's folded norm rounds it."""
    v = _vector(ptr, K, BLOCK_K)
    rstd = tl.rsqrt(tl.sum(v * v, 0) / K + eps)
    return (v * rstd * _vector(nw_ptr, K, BLOCK_K)).to(dtype).to(tl.float32)


@triton.jit
def _rows_plus_residual(w, v, res_ptr, out_ptr, tile, N, BLOCK_N: tl.constexpr):
    """out[rows of this tile] = res + w @ v, for the tile w [BLOCK_N, K] of W's rows."""
    y = tl.sum(w.to(tl.float32) * v[None, :], 1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    residual = tl.load(res_ptr + n, mask=n < N, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + n, (y + residual).to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _chain_kernel(x_ptr, h_ptr, qkv_ptr, act_ptr, logits_ptr, bar_ptr,
                  w_qkv, w_o, w_gu, w_down, w_lm, nw_attn, nw_mlp, nw_final, layers, eps,
                  HIDDEN: tl.constexpr, QKV: tl.constexpr, ATTN: tl.constexpr, INTER: tl.constexpr, VOCAB: tl.constexpr,
                  BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
                  BK_H: tl.constexpr, BK_A: tl.constexpr, BK_I: tl.constexpr,
                  WAIT: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    phase = 0
    dtype = x_ptr.dtype.element_ty
    w = _row_tile(w_qkv, pid, QKV, HIDDEN, BN_QKV, BK_H)  # layer 0's q/k/v tile: x is ready at launch
    for layer in range(layers):
        # q/k/v = (nw * rmsnorm(x)) @ Wqkv.T
        xn = _normed(x_ptr, nw_attn + layer * HIDDEN, HIDDEN, eps, dtype, BK_H)
        y = tl.sum(w.to(tl.float32) * xn[None, :], 1)
        _store_rows(qkv_ptr, pid, y.to(dtype), QKV, BN_QKV)
        o_w = _row_tile(w_o + layer * HIDDEN * ATTN, pid, HIDDEN, ATTN, BN_O, BK_A)  # next phase's W, before the wait
        phase += 1
        _arrive_and_wait(bar_ptr, phase * programs, WAIT)
        # h = x + attn @ Wo.T (attn: the first ATTN values of q/k/v; no attention in this probe)
        _rows_plus_residual(o_w, _vector(qkv_ptr, ATTN, BK_A), x_ptr, h_ptr, pid, HIDDEN, BN_O)
        gate_w = _row_tile(w_gu + layer * 2 * INTER * HIDDEN, pid, INTER, HIDDEN, BN_GU, BK_H)
        up_w = _row_tile(w_gu + (layer * 2 + 1) * INTER * HIDDEN, pid, INTER, HIDDEN, BN_GU, BK_H)
        phase += 1
        _arrive_and_wait(bar_ptr, phase * programs, WAIT)
        # act = silu(gate) * up of (nw * rmsnorm(h)) @ Wgu.T
        hn = _normed(h_ptr, nw_mlp + layer * HIDDEN, HIDDEN, eps, dtype, BK_H)
        gate = tl.sum(gate_w.to(tl.float32) * hn[None, :], 1).to(dtype).to(tl.float32)
        up = tl.sum(up_w.to(tl.float32) * hn[None, :], 1).to(dtype).to(tl.float32)
        _store_rows(act_ptr, pid, (gate * tl.sigmoid(gate) * up).to(dtype), INTER, BN_GU)
        down_w = _row_tile(w_down + layer * HIDDEN * INTER, pid, HIDDEN, INTER, BN_DOWN, BK_I)
        phase += 1
        _arrive_and_wait(bar_ptr, phase * programs, WAIT)
        # x = h + act @ Wdown.T
        _rows_plus_residual(down_w, _vector(act_ptr, INTER, BK_I), h_ptr, x_ptr, pid, HIDDEN, BN_DOWN)
        if layer + 1 < layers:
            w = _row_tile(w_qkv + (layer + 1) * QKV * HIDDEN, pid, QKV, HIDDEN, BN_QKV, BK_H)
        else:
            w = _row_tile(w_lm, pid, VOCAB, HIDDEN, BN_QKV, BK_H)
        phase += 1
        _arrive_and_wait(bar_ptr, phase * programs, WAIT)
    # logits = (nw * rmsnorm(x)) @ Wlm.T, BN_QKV rows at a time per program
    xn = _normed(x_ptr, nw_final, HIDDEN, eps, dtype, BK_H)
    y = tl.sum(w.to(tl.float32) * xn[None, :], 1)
    _store_rows(logits_ptr, pid, y.to(dtype), VOCAB, BN_QKV)
    for tile in range(pid + programs, tl.cdiv(VOCAB, BN_QKV), programs):
        y = tl.sum(_row_tile(w_lm, tile, VOCAB, HIDDEN, BN_QKV, BK_H).to(tl.float32) * xn[None, :], 1)
        _store_rows(logits_ptr, tile, y.to(dtype), VOCAB, BN_QKV)


class Chain:
    """Random weights of `shape` for `layers` layers, the persistent launch and the gemv-launch chain over them."""

    def __init__(self, shape: dict, layers: int, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        def rand(*size, scale=0.02):
            return (torch.randn(*size, generator=generator, device="cpu") * scale).to(device, dtype)
        self.shape, self.layers, self.device, self.dtype = shape, layers, device, dtype
        h, i = shape["hidden"], shape["inter"]
        self.w_qkv, self.w_o = rand(layers, shape["qkv"], h), rand(layers, h, shape["attn"])
        self.w_gu, self.w_down = rand(layers, 2, i, h), rand(layers, h, i)
        self.w_lm = rand(shape["vocab"], h)
        self.nw_attn, self.nw_mlp = 1 + rand(layers, h, scale=0.1), 1 + rand(layers, h, scale=0.1)
        self.nw_final = 1 + rand(h, scale=0.1)
        self.x0 = rand(1, h, scale=1.0)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (self.w_qkv, self.w_o, self.w_gu, self.w_down,
                                                                        self.w_lm))

    def persistent(self, programs: int, warps: int = 4, wait: int = 1):
        """A callable running the whole chain as one launch of `programs` programs; returns the logits buffer."""
        s = self.shape
        x, h = self.x0.clone().view(-1), torch.empty(s["hidden"], device=self.device, dtype=self.dtype)
        qkv = torch.empty(s["qkv"], device=self.device, dtype=self.dtype)
        act = torch.empty(s["inter"], device=self.device, dtype=self.dtype)
        logits = torch.empty(s["vocab"], device=self.device, dtype=self.dtype)
        bar = torch.zeros(1, device=self.device, dtype=torch.int32)
        # One tile of rows per program and phase (the LM head loops, in tiles of q/k/v's height): rows per tile
        # rounded up to a power of two.
        def rows(n):
            return max(1, triton.next_power_of_2(triton.cdiv(n, programs)))
        blocks = dict(BN_QKV=rows(s["qkv"]), BN_O=rows(s["hidden"]), BN_GU=rows(s["inter"]),
                      BN_DOWN=rows(s["hidden"]), BK_H=triton.next_power_of_2(s["hidden"]),
                      BK_A=triton.next_power_of_2(s["attn"]), BK_I=triton.next_power_of_2(s["inter"]))

        def run():
            # Two small kernels per chain (about 3 us of the ~0.6 ms): the input back in place, the counter at 0.
            x.copy_(self.x0.view(-1))
            bar.zero_()
            _chain_kernel[(programs,)](
                x, h, qkv, act, logits, bar, self.w_qkv, self.w_o, self.w_gu, self.w_down, self.w_lm,
                self.nw_attn, self.nw_mlp, self.nw_final, self.layers, EPS,
                HIDDEN=s["hidden"], QKV=s["qkv"], ATTN=s["attn"], INTER=s["inter"], VOCAB=s["vocab"], **blocks,
                WAIT=wait, num_warps=warps)
            return logits
        return run

    def launches(self, configs: dict | None = None, source_layers: list[int] | None = None,
                 before_product: Callable[[int], None] | None = None, activations: torch.dtype | None = None):
        """The engine's way: one gemv launch per product (kernels/gemv.py, PDL), the norms, residual adds and
        SwiGLU folded in as the engine folds them: 4 launches a layer and the LM head. configs: a gemv setting
        by product ("qkv", "o", "gate_up", "down", "lm_head"); absent ones take gemv's defaults.
        source_layers: the layer whose weights each layer reads (its own by default). before_product(index) is
        called before each layer's product is launched, index counting them in order (4 a layer).
        activations: the dtype of x, the stream and the norm weights (the weights' by default)."""
        from dendrite_nb.kernels.gemv import gemv

        s = self.shape
        w_gu = self.w_gu.view(self.layers, 2 * s["inter"], s["hidden"])
        dtype = activations or self.dtype
        x0, nw_attn, nw_mlp, nw_final = (t.to(dtype) for t in (self.x0, self.nw_attn, self.nw_mlp, self.nw_final))
        config = (configs or {}).get
        sources = source_layers if source_layers is not None else range(self.layers)
        before = before_product or (lambda index: None)

        def run():
            x, residual = x0, None   # the stream is x + residual
            for layer, source in enumerate(sources):
                before(4 * layer)
                qkv, stream = gemv(x, self.w_qkv[source], norm=(residual, nw_attn[source], EPS), config=config("qkv"))
                before(4 * layer + 1)
                o = gemv(qkv[:, :s["attn"]], self.w_o[source], config=config("o"))
                before(4 * layer + 2)
                act, stream = gemv(o, w_gu[source], norm=(stream, nw_mlp[source], EPS), swiglu=True,
                                   config=config("gate_up"))
                before(4 * layer + 3)
                x, residual = gemv(act, self.w_down[source], config=config("down")), stream
            return gemv(x, self.w_lm, norm=(residual, nw_final, EPS), config=config("lm_head"))[0].view(-1)
        return run

    def reference(self) -> torch.Tensor:
        """The same chain in float32 torch."""
        s, f = self.shape, (lambda t: t.float())
        x = f(self.x0)

        def norm(v, weight):
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * f(weight)
        for layer in range(self.layers):
            qkv = F.linear(norm(x, self.nw_attn[layer]), f(self.w_qkv[layer]))
            h = x + F.linear(qkv[:, :s["attn"]], f(self.w_o[layer]))
            gate_up = norm(h, self.nw_mlp[layer])
            gate, up = F.linear(gate_up, f(self.w_gu[layer, 0])), F.linear(gate_up, f(self.w_gu[layer, 1]))
            x = h + F.linear(F.silu(gate) * up, f(self.w_down[layer]))
        return F.linear(norm(x, self.nw_final), f(self.w_lm)).view(-1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    device = probe_device("one program, tiny shapes")
    if device.type == "cpu":   # the interpreter runs programs one after another: one program, or it would spin
        check_tiny_chain(device, "persistent chain, 1 program", lambda chain: chain.persistent(1),
                         "gemv launches", lambda chain: chain.launches())
        return
    chain, bandwidth, floor_ms, reference = real_shape_chain(args.layers, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"0.6B chain of products, {args.layers} layers + LM head, one row, bf16: {chain.weight_bytes / 1e9:.2f} GB "
          f"of weights; floor {floor_ms:.3f} ms at {bandwidth / 1e12:.2f} TB/s (copy bandwidth)")
    variants = {"gemv launches (the engine's, PDL)": chain.launches()}
    for p in args.programs_per_sm:
        warps = max(1, 8 // p)
        variants[f"persistent, {p}/SM ({p * sms} programs)"] = chain.persistent(p * sms, warps)
        variants[f"  {p}/SM, polling with acquire loads"] = chain.persistent(p * sms, warps, wait=2)
        variants[f"  {p}/SM, no waits (wrong; a bound)"] = chain.persistent(p * sms, warps, wait=0)
    print_chain_times(variants, reference, device, floor_ms)


def check_tiny_chain(device: torch.device, label: str, variant: Callable[[Chain], Callable[[], torch.Tensor]],
                     control_label: str, control: Callable[[Chain], Callable[[], torch.Tensor]]) -> None:
    """The interpreter's correctness check of a chain probe: `variant` and `control` (each built from a tiny
    float32 chain of 2 layers) against torch float32; prints both errors and exits past 1e-4."""
    chain = Chain(TINY, 2, device, torch.float32, torch.Generator().manual_seed(0))
    reference = chain.reference()
    error, control_error = (relative_error(build(chain)(), reference) for build in (variant, control))
    print(f"interpreter, tiny shapes: {label} relative error {error:.2e} against torch float32 "
          f"({control_label}: {control_error:.2e})")
    if max(error, control_error) > 1e-4:
        raise SystemExit(f"the {label} or the {control_label} does not match torch")


def probe_device(interpreter_shapes: str) -> torch.device:
    """cuda, or the CPU under TRITON_INTERPRET=1 (the probes' correctness check); otherwise exit saying so."""
    interpreting = triton.knobs.runtime.interpret
    if not torch.cuda.is_available() and not interpreting:
        raise SystemExit(f"run it on a GPU, or on the CPU with TRITON_INTERPRET=1 ({interpreter_shapes})")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")


def real_shape_chain(layers: int, device: torch.device) -> tuple[Chain, float, float, torch.Tensor]:
    """The 0.6B chain in bf16 (seed 0), the copy bandwidth measured here (bytes/s), the weights' floor (ms) and
    the float32 reference logits: what each chain probe times its variants against."""
    from bench_common import measure_copy_bandwidth

    chain = Chain(SHAPE_06B, layers, device, torch.bfloat16, torch.Generator().manual_seed(0))
    bandwidth = measure_copy_bandwidth(device)
    return chain, bandwidth, chain.weight_bytes / bandwidth * 1e3, chain.reference()


def print_chain_times(variants: dict[str, Callable[[], torch.Tensor]], reference: torch.Tensor,
                      device: torch.device, floor_ms: float, width: int = 36) -> None:
    """Each chain's error against the float32 reference, then its time as a CUDA graph (median of 3 x 10 calls)."""
    from bench_common import graph_seconds

    for label, run in variants.items():
        error = relative_error(run(), reference)
        seconds = [graph_seconds(run, device, calls=10, flush_l2=False) for _ in range(3)]
        ms = statistics.median(seconds) * 1e3
        print(f"  {label:<{width}} {ms:7.3f} ms  {ms / floor_ms:5.2f}x floor   rel. error vs float32 {error:.2e}")


if __name__ == "__main__":
    main()
