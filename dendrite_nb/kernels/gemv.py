"""Matrix-vector products for decode steps of a few rows: y = x @ W.T (+ b), W [N, K] with contiguous rows.

cuBLAS runs the M = 1 GEMMs of a 0.6B model at about a third of memory bandwidth (benchmarks/REPORT.md): its
tiles are built for more rows. Here a program reads BLOCK_N rows of W in BLOCK_K columns at a time for one
row of x, accumulates products elementwise in float32 and reduces once at the end; the rows of x (at most
MAX_ROWS) are a second grid axis and find W in the L2 cache. Rounded to x's dtype once, as cuBLAS does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

MAX_ROWS = 4  # above this, cuBLAS's tiles pay
ACC_ELEMENTS = 8192  # BLOCK_N x BLOCK_K float32 accumulators per program (64 registers a thread at 4 warps)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    n_valid = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_valid, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_valid)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, contiguous rows) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype."""
    rows, width = x.shape
    out_features = weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != width or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [M <= {MAX_ROWS}, K] and weight [N, K] with contiguous rows; got "
                         f"{tuple(x.shape)} (strides {x.stride()}) and {tuple(weight.shape)} (strides {weight.stride()}).")
    y = x.new_empty(rows, out_features)
    # Enough programs to cover the GPU for small N (o_proj: N = 1,024 -> 256 programs), wide tiles for the LM head.
    block_n = max(4, min(64, triton.next_power_of_2(max(1, out_features // 512))))
    block_k = min(triton.next_power_of_2(width), ACC_ELEMENTS // block_n)
    _gemv_kernel[(triton.cdiv(out_features, block_n), rows)](
        x, weight, bias if bias is not None else weight, y, out_features, width, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through gemv for a decode step of at most MAX_ROWS rows."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(1) == 1:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
