"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running; it waits
(`wait_for_inputs`) before its first write and before it reads anything the previous kernel may write. Each
kernel lets the next one launch right after its own wait, so at most two kernels are in flight and every
kernel before the previous one has finished. So what comes before the wait may read only what was written
before the previous kernel: weights (the GEMVs' first tiles of W), the attention plan (uploaded before the
step: the attention kernel's items, rows and positions, the merge's slots) and the RoPE table (made before
the first layer). Those loads then overlap the previous kernel's tail, as does the launch itself.

Why: a one-row decode step of a 0.6B model is about 200 kernels of 2 to 10 us each. On an H200 its chain of
GEMVs alone went from 0.673 to 0.473 ms with PDL and the weight loads moved before the wait
(docs/lab/gpu-fast-path.md). Kernels without PDL (torch's, cuBLAS's) keep full stream order around these.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# How the kernels were defined: the interpreter decides at definition time, not at launch. (Defined here, the
# first module of the package to load, and re-exported by the package.)
INTERPRETED = bool(triton.knobs.runtime.interpret)


def uses_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels on tensor's device launch with PDL: a CUDA device of compute capability 9 or later."""
    return tensor.is_cuda and _device_uses_pdl(tensor.device)


@functools.lru_cache(maxsize=None)
def _device_uses_pdl(device: torch.device) -> bool:
    return not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_arguments(tensor: torch.Tensor) -> dict[str, bool]:
    """Keywords for launching a kernel that takes a `PDL: tl.constexpr` and calls wait_for_inputs(PDL): the
    flag and the launch option together, so a kernel is never launched early without waiting."""
    return {"PDL": True, "launch_pdl": True} if uses_pdl(tensor) else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
