"""Matrix products of a few rows (2 to 16: a batched decode step, such as a search's 5 leaves) on tensor cores,
y = x @ W.T (+ b), with the same folds as gemv.py: the RMSNorm (and the residual add before it) in the
prologue, the SwiGLU in the epilogue.

A program owns BLOCK_N rows of W and all rows of x (padded to 16, the smallest tile tl.dot takes), and walks
K in BLOCK_K chunks: each W tile is read once for every row of x, so the kernel streams W like a one-row
GEMV, and the few rows cost tensor-core time that is far below the memory time.

Why not cuBLAS, which runs these shapes near bandwidth: at a few rows a decode layer is ten kernels, and the
ones between the products (the norms before q/k/v and gate/up, the SwiGLU after it) are each a launch and a
ramp for a few KB. Folding them here takes three kernels a layer away. And this kernel, unlike cuBLAS,
launches under PDL (pdl.py), so its launch overlaps the kernel before it.

The norm folds in one pass over x: weight * rmsnorm(s) @ W.T equals rstd * ((weight * s) @ W.T) row by
row, so each chunk of the stream s (x + residual) feeds the product and the sum of squares together, and
the rstd scales the products at the end. Two passes (rstd first, as gemv.py does) cost a serial read of x
in every program. So the rounding differs from the separate kernels' in one place: weight * s is rounded
to x's dtype where they round rmsnorm(s) and then weight * rmsnorm(s). The SwiGLU rounds as swiglu.py does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .gemv import _weight_tile, check_folds
from .pdl import pdl_arguments, wait_for_inputs
from .swiglu import silu_times_up

MIN_ROWS, MAX_ROWS = 2, 16  # the rows skinny() takes; fewer go to gemv, more to cuBLAS
BLOCK_M = 16  # x's rows padded to tl.dot's smallest tile


@triton.jit
def _skinny_kernel(x_ptr, res_ptr, nw_ptr, sum_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   stride_xm, stride_rm, stride_sm, stride_wn, stride_ym, eps,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    # N: output features (with SWIGLU, the intermediate size; W then has 2N rows, gate above up).
    pid_n = tl.program_id(0)
    dtype = y_ptr.dtype.element_ty
    m = tl.arange(0, BLOCK_M)
    m_valid = m < M  # padding rows are masked: they load nothing and are never stored
    # x is read transposed, [BLOCK_K, BLOCK_M] chunks, as the product's second operand.
    x_cols = x_ptr + m[None, :] * stride_xm
    res_cols = res_ptr + m[None, :] * stride_rm
    sum_cols = sum_ptr + m[None, :] * stride_sm
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWIGLU only
    squares = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)  # NORM only
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        mask = k_valid[:, None] & m_valid[None, :]
        w, up = _weight_tile(w_rows, N * stride_wn, k, n_valid[:, None] & k_valid[None, :], SWIGLU)
        x = tl.load(x_cols + k[:, None], mask=mask, other=0.0)
        if NORM:  # one pass: the stream's squares add up here, and its rstd scales the products at the end
            stream = x.to(tl.float32)
            if RESIDUAL:  # the stream is x + residual, rounded as the reference adds; the first program stores it
                stream = (stream + tl.load(res_cols + k[:, None], mask=mask, other=0.0).to(tl.float32)).to(dtype)
                # `k * 0 + pid_n`: the mask as a tensor; the interpreter refuses a tensor & scalar mask.
                tl.store(sum_cols + k[:, None], stream, mask=mask & (k[:, None] * 0 + pid_n == 0))
                stream = stream.to(tl.float32)
            squares += stream * stream
            x = (stream * tl.load(nw_ptr + k, mask=k_valid, other=0.0).to(tl.float32)[:, None]).to(dtype)
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
        if SWIGLU:
            acc_up = tl.dot(up, x, acc_up, input_precision=PRECISION)
    if NORM:  # weight * rmsnorm(s) @ W.T = rstd * ((weight * s) @ W.T), row by row
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)[None, :]
        acc *= rstd
        acc_up *= rstd
    y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:  # silu(gate) * up, each product rounded first, as the unfused path rounds its gate_up
        up_y = acc_up
        if HAS_BIAS:
            up_y += tl.load(b_ptr + N + n, mask=n_valid, other=0.0).to(tl.float32)[:, None]
        y = silu_times_up(y, up_y, dtype)
    tl.store(y_ptr + m[None, :] * stride_ym + n[:, None], y.to(dtype), mask=n_valid[:, None] & m_valid[None, :])


def default_config(out_features: int, width: int, norm: bool = False,
                   swiglu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [out_features, width] product: the fastest of a sweep of
    30 settings at 8 rows over the 0.6B and 8B projections and LM heads (H200, L2 flushed,
    benchmarks/REPORT.md), within 3% of each shape's own fastest. The folded norm takes more rows of W per
    program (its x chunk costs more, so each serves more of W); an LM head, narrower chunks."""
    if swiglu:
        block_n, block_k, warps, stages = 64, 128, 8, 4
    elif norm:
        block_n, block_k, warps, stages = 64, 256, 4, 4
    elif out_features >= 32768:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    else:
        block_n, block_k, warps, stages = 32, 256, 4, 6
    return block_n, max(16, min(block_k, triton.next_power_of_2(width))), warps, stages


def smaller_config(config: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The next setting to try when `config` needs more shared memory than the GPU has (a smaller GPU than the
    one the defaults were tuned on, or float32): fewer stages, then narrower chunks, then fewer rows of W."""
    block_n, block_k, warps, stages = config
    if stages > 2:
        return block_n, block_k, warps, 2
    if block_k > 32:
        return block_n, block_k // 2, warps, stages
    if block_n > 16:
        return block_n // 2, block_k, warps, stages
    return None


# A requested setting (with what else changes shared memory) -> the setting that fitted on this GPU.
_FITTED: dict[tuple, tuple[int, int, int, int]] = {}


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None, swiglu: bool = False,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (MIN_ROWS <= M <= MAX_ROWS, contiguous rows) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype.

    norm and swiglu as in gemv(): with norm = (residual or None, norm_weight, eps) the product reads
    weight * rmsnorm(x + residual) and the call returns (y, x + residual); with swiglu, weight is gate rows
    above up rows and y is silu(gate) * up. config: (BLOCK_N, BLOCK_K, num_warps, num_stages), for tuning;
    a setting that needs more shared memory than this GPU has steps down (smaller_config) until one fits.
    """
    rows, width = x.shape
    if not MIN_ROWS <= rows <= MAX_ROWS or weight.shape[1] != width or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny takes x [{MIN_ROWS} <= M <= {MAX_ROWS}, K] and weight [N, K] with contiguous "
                         f"rows; got {tuple(x.shape)} (strides {x.stride()}) and {tuple(weight.shape)} (strides "
                         f"{weight.stride()}).")
    out_features = check_folds(x, weight, norm, swiglu)
    residual, norm_weight, eps = norm if norm is not None else (None, None, 0.0)
    y = x.new_empty(rows, out_features)
    summed = torch.empty_like(x) if residual is not None else None
    requested = config or default_config(out_features, width, norm is not None, swiglu)
    key = (requested, x.dtype, x.device, norm is not None, swiglu)
    config = _FITTED.get(key, requested)
    while True:
        try:
            _launch(config, x, residual, norm_weight, summed, weight, bias, y, eps, norm is not None, swiglu)
            break
        except OutOfResources:
            config = smaller_config(config)
            if config is None:
                raise
    _FITTED[key] = config
    if norm is None:
        return y
    return y, (summed if summed is not None else x)


def _launch(config, x, residual, norm_weight, summed, weight, bias, y, eps, norm: bool, swiglu: bool) -> None:
    block_n, block_k, warps, stages = config
    rows, width = x.shape
    out_features = y.shape[1]
    _skinny_kernel[(triton.cdiv(out_features, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        summed if summed is not None else y, weight, bias if bias is not None else weight, y, rows, out_features,
        width, x.stride(0), residual.stride(0) if residual is not None else 0,
        summed.stride(0) if summed is not None else 0, weight.stride(0), y.stride(0), eps,
        HAS_BIAS=bias is not None, NORM=norm, RESIDUAL=residual is not None, SWIGLU=swiglu,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        **pdl_arguments(x))
