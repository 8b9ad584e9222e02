"""Probe: does a one-row decode step get faster with each layer's MLP as ONE launch instead of two?

Decode (b), one leaf of a 0.6B model, is latency-bound: with every weight already in L2 its chain of 113 GEMVs
still takes 0.396 ms, about 3.5 us a launch (docs/lab/gpu-decode-step.md). A persistent kernel lost to the launches
because its grid barriers cost more than a PDL boundary. This probe removes a boundary instead of replacing it:
gate/up (with the norm and the SwiGLU) and down become one kernel, split over the intermediate size.

A program owns BLOCK_I intermediate features: their gate and up rows of W_gu and the same rows of W_down
transposed (stored [intermediate, hidden] so that they too are contiguous). All three tiles load before the
PDL wait, so they stream while the kernel before finishes. After the wait it norms the row, computes its
BLOCK_I SwiGLU values and multiplies them into a partial [hidden] output, which it adds into a float32 buffer
with atomics. So down_proj needs no second launch and no round trip of the activation through memory; the
price is the atomics (programs x hidden of them) and a float32 output that the next layer's norm reads as its x.
The buffers of all layers are zeroed by one memset at the start of the step.

Printed beside it in the same run: the engine's chain of gemv launches (kernels/gemv.py, 4 a layer, PDL) over
the same weights, and the floor (the weights' bytes over the copy bandwidth). All chains are CUDA graphs.
In the fused chain the stream between layers is float32 (the next gemv's x is the atomics' sum), so the fair
peer is the control: the same 4 gemv launches a layer with float32 activations (60 us slower a chain than
bf16 on an H200). Result (docs/lab/gpu-decode-step.md): the fused MLP is 2-3% slower than the control.

    python docs/lab/probes/probe_fused_mlp.py [--layers 28] [--block-i 8 16 32] [--warps 4 8]

A probe, not an engine path: its result is in docs/lab/gpu-decode-step.md. With TRITON_INTERPRET=1
(tiny shapes) it checks the fused chain against torch on the CPU.
"""
from __future__ import annotations

import sys
from pathlib import Path
import argparse

import torch
import triton
import triton.language as tl

# A lab probe (docs/lab/probes/README.md); the benchmark helpers it imports (bench_common and the scripts
# beside it) stay in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from probe_persistent_chain import (EPS, Chain, check_tiny_chain, print_chain_times, probe_device,  # noqa: E402
                                    real_shape_chain)
from dendrite_nb.kernels.gemv import gemv  # noqa: E402
from dendrite_nb.kernels.pdl import pdl_arguments, wait_for_inputs  # noqa: E402
from dendrite_nb.kernels.swiglu import silu_times_up  # noqa: E402


# How a program adds its partial output (the kernel's ADD); constexpr, as Triton reads globals only as such.
ATOMIC, STORE_BOUND = tl.constexpr(0), tl.constexpr(1)


@triton.jit
def _fused_mlp_kernel(x_ptr, res_ptr, nw_ptr, sum_ptr, w_gu_ptr, w_down_t_ptr, out_ptr, INTER, eps,
                      HIDDEN: tl.constexpr, BLOCK_I: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    """out[HIDDEN] += W_down[:, rows] @ swiglu(W_gu[rows] @ (nw * rmsnorm(x + res))) for this program's rows;
    program 0 stores x + res to sum_ptr (the residual stream after attention, which the next layer adds)."""
    pid = tl.program_id(0)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    k = tl.arange(0, HIDDEN)
    rows = i[:, None].to(tl.int64) * HIDDEN + k[None, :]
    valid = (i < INTER)[:, None]
    gate_w = tl.load(w_gu_ptr + rows, mask=valid, other=0.0)  # weights: before the wait (no kernel writes them)
    up_w = tl.load(w_gu_ptr + INTER * HIDDEN + rows, mask=valid, other=0.0)
    down_w = tl.load(w_down_t_ptr + rows, mask=valid, other=0.0)
    wait_for_inputs(PDL)
    dtype = sum_ptr.dtype.element_ty
    h = (tl.load(x_ptr + k).to(tl.float32) + tl.load(res_ptr + k).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(sum_ptr + k, h.to(dtype), mask=k * 0 + pid == 0)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    normed = (tl.load(nw_ptr + k).to(tl.float32) * (h * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    gate = tl.sum(gate_w.to(tl.float32) * normed[None, :], 1)
    up = tl.sum(up_w.to(tl.float32) * normed[None, :], 1)
    act = silu_times_up(gate, up, dtype).to(dtype).to(tl.float32)  # [BLOCK_I]
    partial = tl.sum(down_w.to(tl.float32) * act[:, None], 0)  # [HIDDEN]
    if ADD == ATOMIC:
        tl.atomic_add(out_ptr + k, partial, sem="relaxed")
    else:  # STORE_BOUND: wrong results (the last program's partial wins); what the atomics cost, at most
        tl.store(out_ptr + k, partial)


class FusedMlpChain:
    """chain's weights, with W_down stored transposed, run as 3 launches a layer: q/k/v, o, the fused MLP."""

    def __init__(self, chain: Chain):
        self.chain = chain
        self.w_down_t = chain.w_down.transpose(1, 2).contiguous()  # [layers, inter, hidden]

    def launches(self, block_i: int, warps: int, add: int = ATOMIC):
        c, s = self.chain, self.chain.shape
        hidden, inter = s["hidden"], s["inter"]
        assert hidden & (hidden - 1) == 0, "the probe's kernel reads the hidden row whole: a power of two"
        outs = torch.empty(c.layers, 1, hidden, device=c.device, dtype=torch.float32)
        stream_dtype = torch.float32  # the next gemv reads out (float32) as x: its residual must match
        w_gu = c.w_gu.view(c.layers, 2 * inter, hidden)
        nw_attn, nw_final = c.nw_attn.to(stream_dtype), c.nw_final.to(stream_dtype)  # gemv's norm weight: x's dtype
        grid = (triton.cdiv(inter, block_i),)

        def run():
            outs.zero_()  # one memset for every layer's sums
            x, residual = c.x0.to(stream_dtype), None
            for layer in range(c.layers):
                qkv, stream = gemv(x, c.w_qkv[layer], norm=(residual, nw_attn[layer], EPS))
                o = gemv(qkv[:, :s["attn"]], c.w_o[layer])
                summed = torch.empty_like(o)
                _fused_mlp_kernel[grid](o, stream, c.nw_mlp[layer], summed, w_gu[layer], self.w_down_t[layer],
                                        outs[layer], inter, EPS, HIDDEN=hidden, BLOCK_I=block_i, ADD=getattr(add, "value", add), num_warps=warps,
                                        **pdl_arguments(o))
                x, residual = outs[layer], summed
            return gemv(x, c.w_lm, norm=(residual, nw_final, EPS))[0].view(-1)
        return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--block-i", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args(argv)
    device = probe_device("tiny shapes")
    if device.type == "cpu":
        check_tiny_chain(device, "fused-MLP chain", lambda chain: FusedMlpChain(chain).launches(16, 4),
                         "the control", lambda chain: chain.launches(activations=torch.float32))
        return
    chain, bandwidth, floor_ms, reference = real_shape_chain(args.layers, device)
    fused = FusedMlpChain(chain)
    print(f"{torch.cuda.get_device_name(device)}: 0.6B chain of products, {args.layers} layers + LM head, one row, "
          f"bf16 weights: {chain.weight_bytes / 1e9:.2f} GB; floor {floor_ms:.3f} ms at {bandwidth / 1e12:.2f} TB/s")
    variants = {"gemv launches, 4 a layer (the engine's)": chain.launches(),
                "  the same, float32 activations (the control)": chain.launches(activations=torch.float32)}
    for block_i in args.block_i:
        for warps in args.warps:
            variants[f"fused MLP, 3 a layer, BLOCK_I {block_i}, {warps} warps"] = fused.launches(block_i, warps)
            variants[f"  {block_i}, {warps}: stores (wrong; a bound)"] = fused.launches(block_i, warps, STORE_BOUND)
    print_chain_times(variants, reference, device, floor_ms, width=48)


if __name__ == "__main__":
    main()
