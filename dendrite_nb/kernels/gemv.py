"""Matrix-vector products for decode steps of a few rows: y = x @ W.T (+ b), W [N, K] with contiguous rows,
optionally with the RMSNorm before it (and the residual add before that) folded into its prologue, or the
SwiGLU after it folded into its epilogue.

cuBLAS runs the M = 1 GEMMs of a 0.6B model at about a third of memory bandwidth (docs/lab/gpu-decode-step.md): its
tiles are built for more rows. Here a program reads BLOCK_N rows of W in BLOCK_K columns at a time for one
row of x, accumulates products elementwise in float32 and reduces once at the end; the rows of x (at most
MAX_ROWS) are a second grid axis and find W in the L2 cache. Rounded to x's dtype once, as cuBLAS does.

Why fold: at one row a decode layer's kernels are each a few microseconds, so a layer of ten is launch and
ramp time more than bytes. The norm needs the whole row of x (a few KB, from L2), which every program reads
again to get the same rstd, so the norm's own kernel and its round trip through memory go away; the SwiGLU
needs a gate row and its up row, which one program reads side by side. Rounding follows the separate kernels
(norm.py, swiglu.py) step for step; only the order of the float32 sum of squares differs.

Why the first two K chunks of W load before anything else: they depend on no other kernel, so under
programmatic dependent launch (pdl.py) they stream in while the kernel before is still finishing. On an
H200 a 0.6B step's 113 GEMVs went from 0.673 to 0.473 ms as a CUDA graph with this (docs/lab/gpu-fast-path.md).

FP8 weights (HAS_SCALE): W is read as e4m3, half of bf16's bytes, which is what bounds a one-row step, and
widened to float32 in registers; each row's float32 scale multiplies its sum in the epilogue, before the bias
and the SwiGLU (gate and up rows each their own), so x keeps its precision (fp8_linear.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_linear import check_weight_scale
from .pdl import pdl_arguments, wait_for_inputs
from .swiglu import silu_times_up

MAX_ROWS = 4  # the most rows gemv() takes
ACC_ELEMENTS = 8192  # BLOCK_N x BLOCK_K float32 accumulators per program (64 registers a thread at 4 warps)


@triton.jit
def _normed_chunk(x_ptr, res_ptr, nw_ptr, k, k_valid, rstd, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                  dtype: tl.constexpr):
    """x[k] as the matrix product sees it: raw, or weight * rmsnorm(x (+ residual)) rounded as norm.py does."""
    x = tl.load(x_ptr + k, mask=k_valid, other=0.0).to(tl.float32)
    if NORM:
        if RESIDUAL:
            x = (x + tl.load(res_ptr + k, mask=k_valid, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        normed = (x * rstd).to(dtype).to(tl.float32)
        x = (tl.load(nw_ptr + k, mask=k_valid, other=0.0).to(tl.float32) * normed).to(dtype).to(tl.float32)
    return x


@triton.jit
def _weight_tile(w_rows, up_offset, k, mask, SWIGLU: tl.constexpr):
    """W's [BLOCK_N, BLOCK_K] tile at columns k, and with SWIGLU the up rows' tile (the same tile otherwise)."""
    w = tl.load(w_rows + k[None, :], mask=mask, other=0.0)
    up = w
    if SWIGLU:
        up = tl.load(w_rows + up_offset + k[None, :], mask=mask, other=0.0)
    return w, up


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, sum_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K,
                 stride_xm, stride_rm, stride_sm, stride_wn, stride_ym, eps,
                 HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
                 HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # N: output features (with SWIGLU, the intermediate size; W then has 2N rows, gate above up).
    # HAS_SCALE: W is e4m3 with a float32 scale per row at s_ptr, applied to each row's float32 sum.
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_xm
    res_row = res_ptr + row * stride_rm
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    # The first two chunks of W load before waiting for x: no kernel writes weights, so under PDL these loads
    # overlap the kernel before (pdl.py), and without it they are in flight during the norm's pass over x.
    k_first = tl.arange(0, BLOCK_K)
    k_second = BLOCK_K + k_first
    w_first, up_first = _weight_tile(w_rows, N * stride_wn, k_first, n_valid[:, None] & (k_first < K)[None, :],
                                     SWIGLU)
    w_second, up_second = _weight_tile(w_rows, N * stride_wn, k_second, n_valid[:, None] & (k_second < K)[None, :],
                                       SWIGLU)
    wait_for_inputs(PDL)
    rstd = 0.0
    if NORM:  # a first pass over the row for its rstd; the first column of programs stores x + residual
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_valid = k < K
            x = tl.load(x_row + k, mask=k_valid, other=0.0).to(tl.float32)
            if RESIDUAL:
                x = (x + tl.load(res_row + k, mask=k_valid, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
                # `k * 0 + pid_n`: the mask as a tensor; the interpreter refuses a tensor & scalar mask.
                tl.store(sum_ptr + row * stride_sm + k, x.to(dtype), mask=k_valid & (k * 0 + pid_n == 0))
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    x = _normed_chunk(x_row, res_row, nw_ptr, k_first, k_first < K, rstd, NORM, RESIDUAL, dtype)
    acc = w_first.to(tl.float32) * x[None, :]
    acc_up = up_first.to(tl.float32) * x[None, :]  # SWIGLU only; dead code otherwise
    x = _normed_chunk(x_row, res_row, nw_ptr, k_second, k_second < K, rstd, NORM, RESIDUAL, dtype)
    acc += w_second.to(tl.float32) * x[None, :]
    acc_up += up_second.to(tl.float32) * x[None, :]
    for k0 in range(2 * BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        x = _normed_chunk(x_row, res_row, nw_ptr, k, k_valid, rstd, NORM, RESIDUAL, dtype)
        w, up = _weight_tile(w_rows, N * stride_wn, k, n_valid[:, None] & k_valid[None, :], SWIGLU)
        acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:
            acc_up += up.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_SCALE:
        y *= tl.load(s_ptr + n, mask=n_valid, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)
    if SWIGLU:  # silu(gate) * up, each matrix product rounded first, as the unfused path rounds its gate_up
        up = tl.sum(acc_up, 1)
        if HAS_SCALE:
            up *= tl.load(s_ptr + N + n, mask=n_valid, other=0.0)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + n, mask=n_valid, other=0.0).to(tl.float32)
        y = silu_times_up(y, up, dtype)
    tl.store(y_ptr + row * stride_ym + n, y.to(dtype), mask=n_valid)


def default_config(out_features: int, width: int, swiglu: bool = False,
                   fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [out_features, width] weight: the fastest of a sweep of
    102 settings over the 0.6B and 8B shapes at one row (H200, L2 flushed), then for o_proj and down_proj the
    fastest of four chunk widths in a whole 0.6B step's chain of GEMVs under PDL (docs/lab/gpu-fast-path.md).
    fp8: for an e4m3 weight (fp8_config)."""
    if fp8:
        return fp8_config(out_features, width, swiglu)
    if out_features >= 32768:  # an LM head: 81 us for 152k x 1,024 (3.9 TB/s), 96 us with the rule below
        block_n, block_k, warps = 32, 128, 8
    elif out_features <= 2048:  # few rows of W, each long (o_proj, down_proj): 4 rows a program fill the GPU,
        block_n, block_k, warps = 4, 2048, 8  # and its first two chunks (all of W at 0.6B) load before the wait
    elif out_features * width >= 2**24:  # 8B-sized projections
        block_n, block_k, warps = 4, 128, 8
    else:  # enough programs to cover the GPU, each a few rows of the whole width
        block_n = max(4, min(64, triton.next_power_of_2(max(1, out_features // 512))))
        block_k, warps = min(triton.next_power_of_2(width), ACC_ELEMENTS // block_n), 4
    block_k = min(block_k, triton.next_power_of_2(width))
    return block_n, block_k // (2 if swiglu and block_k > 128 else 1), warps, 3


def fp8_config(out_features: int, width: int, swiglu: bool = False) -> tuple[int, int, int, int]:
    """default_config for an e4m3 weight: wider chunks than bf16's, so that each load still moves 16 bytes and a
    program has as many bytes in flight. The fastest on the whole of 46 settings at one row over the 0.6B and
    8B projections and LM heads (H200, L2 flushed, bf16 x, folds on: benchmarks/fp8_products.py's docstring).
    Against the bf16 weight at its own defaults: 0.6B 0.62-0.98x the time, 8B 0.29-0.74x (bf16's 8B q/k/v
    and gate/up defaults are slow at one row: 54 and 113 us, where skinny takes 20 and 67 at 4 rows)."""
    if out_features >= 32768:  # an LM head: 50 us for 152k x 1,024, 144 us for 128k x 4,096
        block_n, block_k = 16, 512
    elif out_features <= 2048:  # o_proj, down_proj of a small model: one long row of W a program
        block_n, block_k = 1, 1024
    elif out_features * width >= 2**24:  # 8B-sized projections: 8B q/k/v 15 us (bf16 at its defaults: 54)
        block_n, block_k = 4, 2048
    else:
        block_n, block_k = 4, 512
    block_k = min(block_k // (2 if swiglu and block_k > 512 else 1), triton.next_power_of_2(width))
    return block_n, block_k, 4, 3


def check_folds(x: torch.Tensor, weight: torch.Tensor, norm: tuple | None, swiglu: bool) -> int:
    """Raise ValueError unless the folded norm's and SwiGLU's tensors fit x [M, K] and weight (as gemv and
    skinny take them); returns the product's output features."""
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"swiglu needs gate and up stacked, an even number of weight rows; got {weight.shape[0]}.")
    residual, norm_weight, _ = norm if norm is not None else (None, None, 0.0)
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype):
        raise ValueError(f"the norm weight is {tuple(norm_weight.shape)} {norm_weight.dtype}; expected "
                         f"({x.shape[1]},) {x.dtype}, matching x.")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"the residual is {tuple(residual.shape)} {residual.dtype} with strides {residual.stride()}; "
                         f"expected {tuple(x.shape)} {x.dtype} with contiguous rows, like x.")
    return weight.shape[0] // (2 if swiglu else 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None, swiglu: bool = False,
         config: tuple[int, int, int, int] | None = None,
         weight_scale: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= MAX_ROWS, contiguous rows) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype.

    norm = (residual [M, K] or None, norm_weight [K], eps): the product reads weight * rmsnorm(x + residual)
    instead of x and the call returns (y, x + residual) (x itself when residual is None), as add_rms_norm
    followed by the product would. swiglu: weight is [2I, K], gate rows above up rows, and y is
    silu(gate) * up [M, I]. config: (BLOCK_N, BLOCK_K, num_warps, num_stages), for tuning.
    weight_scale: float32 [N] (with swiglu, [2I]) for a float8_e4m3fn weight, which is then read as fp8 and
    stands for weight_scale[:, None] * weight; each row's scale multiplies its float32 sum before the bias
    and the SwiGLU (fp8_linear.py). Needs e4m3 in hardware on a GPU (compute capability 8.9 or later).

    The kernel loads weight before it waits for the kernel launched before it (kernels/pdl.py): weight must
    not be the output of the Triton kernel launched just before this call (model weights never are).
    """
    rows, width = x.shape
    if rows > MAX_ROWS or weight.shape[1] != width or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [M <= {MAX_ROWS}, K] and weight [N, K] with contiguous rows; got "
                         f"{tuple(x.shape)} (strides {x.stride()}) and {tuple(weight.shape)} (strides {weight.stride()}).")
    check_weight_scale(weight, weight_scale)
    out_features = check_folds(x, weight, norm, swiglu)
    residual, norm_weight, eps = norm if norm is not None else (None, None, 0.0)
    y = x.new_empty(rows, out_features)
    summed = torch.empty_like(x) if residual is not None else None
    block_n, block_k, warps, stages = config or default_config(out_features, width, swiglu, weight_scale is not None)
    _gemv_kernel[(triton.cdiv(out_features, block_n), rows)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        summed if summed is not None else y, weight, weight_scale if weight_scale is not None else y,
        bias if bias is not None else weight, y, out_features, width,
        x.stride(0), residual.stride(0) if residual is not None else 0, summed.stride(0) if summed is not None else 0,
        weight.stride(0), y.stride(0), eps, HAS_BIAS=bias is not None, NORM=norm is not None,
        RESIDUAL=residual is not None, SWIGLU=swiglu, HAS_SCALE=weight_scale is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_arguments(x))
    if norm is None:
        return y
    return y, (summed if summed is not None else x)
