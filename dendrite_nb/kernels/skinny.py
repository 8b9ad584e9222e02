"""Matrix products of a few rows (2 to 64: a batched decode step, such as a search's 5 leaves) on tensor cores,
y = x @ W.T (+ b), with the same folds as gemv.py: the RMSNorm (and the residual add before it) in the
prologue, the SwiGLU in the epilogue.

A program owns BLOCK_N rows of W and all rows of x (padded to 16, the smallest tile tl.dot takes, or to 32 or
64), and walks K in BLOCK_K chunks: each W tile is read once for every row of x, so the kernel streams W like
a one-row GEMV, and the few rows cost tensor-core time that is far below the memory time.

Why not cuBLAS, which runs these shapes near bandwidth: at a few rows a decode layer is ten kernels, and the
ones between the products (the norms before q/k/v and gate/up, the SwiGLU after it) are each a launch and a
ramp for a few KB. Folding them here takes three kernels a layer away. And this kernel, unlike cuBLAS,
launches under PDL (pdl.py), so its launch overlaps the kernel before it. Above FOLD_ROWS rows the norm is
better left to its own kernel (every program would redo its elementwise work on all of x: at 64 rows the 8B
q/k/v took 41 us against 22, docs/lab/gpu-fast-path.md); products.py does so. Even then the chains of products at
17 to 64 rows ran 1-7% (8B) and 2-19% (0.6B) faster than cuBLASLt's with the same separate kernels.

The norm folds in one pass over x: weight * rmsnorm(s) @ W.T equals rstd * ((weight * s) @ W.T) row by
row, so each chunk of the stream s (x + residual) feeds the product and the sum of squares together, and
the rstd scales the products at the end. Two passes (rstd first, as gemv.py does) cost a serial read of x
in every program. So the rounding differs from the separate kernels' in one place: weight * s is rounded
to x's dtype where they round rmsnorm(s) and then weight * rmsnorm(s). The SwiGLU rounds as swiglu.py does.

Split-K, for small products: a 0.6B projection is 16 to 64 tiles of W's rows, so most of an H200's 132
multiprocessors would idle. Programs then also split K, and the last program of each tile to finish adds the
partials up in split order (deterministic) and runs the epilogue; no second kernel. On an H200 a 0.6B
model's chain of products at 8 rows went from 0.83 to 0.67 ms with it (docs/lab/gpu-fast-path.md). An 8B
projection is split only while all the split programs stay resident in one wave (o and down: 64 tiles,
2 ways); a second wave of them costs more.

Under PDL each program first asks for its first chunks of W in L2 (default_prefetch), then waits for the kernel
before it: W depends on no kernel, so its first bytes stream in during that kernel's tail. The chains of
products at 8 rows on an H200: 0.6B 0.670 -> 0.630 ms, 8B 3.862 -> 3.810 ms (docs/lab/gpu-fast-path.md).

FP8 weights (HAS_SCALE): W's tiles stream in as e4m3, half of bf16's bytes, and are widened to x's dtype
(exactly: every e4m3 value is a bf16 value) for the tensor cores, so x keeps its precision; the rows' float32
scales multiply the products in the epilogue, after split-K's sum, before the bias and the SwiGLU
(fp8_linear.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .fp8_linear import check_weight_scale
from .gemv import _weight_tile, check_folds
from .pdl import pdl_arguments, wait_for_inputs
from .swiglu import silu_times_up

MIN_ROWS, MAX_ROWS = 2, 64  # the rows skinny() takes; fewer go to gemv
MIN_BLOCK_M = 16  # x's rows are padded at least to tl.dot's smallest tile (row_tile)
FOLD_ROWS = 16  # the most rows at which the norm folds in well (every program redoes its work on all of x)
# W's first BLOCK_K chunks that a program asks into L2 before its PDL wait (default_prefetch), for small products
# (at most SMALL_PRODUCT) or more than FOLD_ROWS rows, and for large ones: the fastest counts in chains of products
# (H200; REPORT "Parts of a step (tuners and profilers)", the runs in docs/lab/constants-history.md).
PREFETCH_SMALL, PREFETCH_LARGE = 1, 2
# Split-K (default_splits, _gather_splits): for products whose tiles along N alone leave multiprocessors idle.
SPLIT_PROGRAMS_PER_SM = 2
MIN_SPLIT_CHUNKS = 2  # BLOCK_K chunks per split at least, so each program still pipelines its loads
SMALL_PRODUCT = 8 << 20  # out_features x width up to which a product takes default_config's small settings


@triton.jit
def _skinny_kernel(x_ptr, res_ptr, nw_ptr, sum_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                   K_SPLIT, stride_xm, stride_rm, stride_sm, stride_wn, stride_ym, eps,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
                   HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLITS: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr,
                   LINE_ELEMENTS: tl.constexpr, PDL: tl.constexpr):
    # N: output features (with SWIGLU, the intermediate size; W then has 2N rows, gate above up).
    # Program (pid_n, pid_k) owns rows [pid_n * BLOCK_N, +BLOCK_N) of W and columns [pid_k * K_SPLIT, +K_SPLIT).
    # HAS_SCALE: W is e4m3 with a float32 scale per row at s_ptr, applied to the float32 products in _finish.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
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
    if PDL and PREFETCH > 0:
        _prefetch_first_chunks(w_ptr, n, N, k_lo, k_hi, stride_wn, SWIGLU, BLOCK_K, PREFETCH, LINES, LINE_ELEMENTS)
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWIGLU only
    squares = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)  # NORM only
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < k_hi
        mask = k_valid[:, None] & m_valid[None, :]
        w, up = _weight_tile(w_rows, N * stride_wn, k, n_valid[:, None] & k_valid[None, :], SWIGLU)
        if HAS_SCALE:  # tl.dot takes both operands in one dtype, and every e4m3 value is exact in x's
            w = w.to(dtype)
            up = up.to(dtype)
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
    row_squares = tl.sum(squares, 0)  # [BLOCK_M]; NORM only
    if SPLITS > 1:  # the last of a tile's SPLITS programs to finish adds up their partials, in split order
        acc, acc_up, row_squares, last = _gather_splits(acc, acc_up, row_squares, part_ptr, count_ptr, pid_n,
                                                        pid_k, NORM, SWIGLU, BLOCK_M, BLOCK_N, SPLITS)
        if last:
            _finish(acc, acc_up, row_squares, s_ptr, b_ptr, y_ptr, m, m_valid, n, n_valid, N, K, stride_ym, eps,
                    dtype, HAS_BIAS, NORM, SWIGLU, HAS_SCALE)
    else:
        _finish(acc, acc_up, row_squares, s_ptr, b_ptr, y_ptr, m, m_valid, n, n_valid, N, K, stride_ym, eps, dtype,
                HAS_BIAS, NORM, SWIGLU, HAS_SCALE)


@triton.jit
def _prefetch_first_chunks(w_ptr, n, N, k_lo, k_hi, stride_wn, SWIGLU: tl.constexpr, BLOCK_K: tl.constexpr,
                           CHUNKS: tl.constexpr, LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
    """Ask for the program's first CHUNKS chunks of W in L2 (one prefetch per 128-byte line: LINES lines of
    LINE_ELEMENTS elements per row of a chunk; nothing into registers), so that they stream in while the kernel
    before this one finishes (PDL). The loop that follows is left as it is, and so is Triton's pipelining of it:
    loading the first chunks into registers instead broke that pipelining (3-4% slower at 8B,
    docs/lab/gpu-decode-step.md). Addresses past W's edge are clamped to it."""
    rows = tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_wn
    lines = tl.arange(0, LINES) * LINE_ELEMENTS
    for c in tl.static_range(CHUNKS):
        cols = tl.minimum(k_lo + c * BLOCK_K + lines, k_hi - 1)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [w_ptr + rows + cols],
                                  dtype=tl.int32, is_pure=False, pack=1)
        if SWIGLU:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [w_ptr + N * stride_wn + rows + cols], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _finish(acc, acc_up, row_squares, s_ptr, b_ptr, y_ptr, m, m_valid, n, n_valid, N, K, stride_ym, eps,
            dtype: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
            HAS_SCALE: tl.constexpr):
    """The epilogue: the norm's rstd, the fp8 weight's scales, the bias, the SwiGLU, the store of y's
    [BLOCK_N, BLOCK_M] tile."""
    if NORM:  # weight * rmsnorm(s) @ W.T = rstd * ((weight * s) @ W.T), row by row
        rstd = tl.rsqrt(row_squares / K + eps)[None, :]
        acc *= rstd
        acc_up *= rstd
    if HAS_SCALE:  # one scale per row of W: per output feature, the tile's first axis (gate, then up)
        acc *= tl.load(s_ptr + n, mask=n_valid, other=0.0)[:, None]
        if SWIGLU:
            acc_up *= tl.load(s_ptr + N + n, mask=n_valid, other=0.0)[:, None]
    y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:  # silu(gate) * up, each product rounded first, as the unfused path rounds its gate_up
        up_y = acc_up
        if HAS_BIAS:
            up_y += tl.load(b_ptr + N + n, mask=n_valid, other=0.0).to(tl.float32)[:, None]
        y = silu_times_up(y, up_y, dtype)
    tl.store(y_ptr + m[None, :] * stride_ym + n[:, None], y.to(dtype), mask=n_valid[:, None] & m_valid[None, :])


@triton.jit
def _gather_splits(acc, acc_up, row_squares, part_ptr, count_ptr, pid_n, pid_k, NORM: tl.constexpr,
                   SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Split-K's reduction without a second kernel: each program of tile pid_n stores its float32 partials,
    then takes a ticket from the tile's counter; the one holding the last ticket reads every split's partials
    back (from L2: .cg) and adds them in split order, so the result does not depend on which program finished
    last. It sets the counter back to 0 for the next launch. Returns (acc, acc_up, row_squares, last)."""
    # Partials [tiles, SPLITS, 3 parts (product, up product, squares), BLOCK_N, BLOCK_M], float32.
    r = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tile_ptr = part_ptr + pid_n.to(tl.int64) * (SPLITS * 3 * BLOCK_N * BLOCK_M)
    mine = tile_ptr + pid_k * (3 * BLOCK_N * BLOCK_M)
    tl.store(mine + r, acc)
    if SWIGLU:
        tl.store(mine + BLOCK_N * BLOCK_M + r, acc_up)
    if NORM:
        tl.store(mine + 2 * BLOCK_N * BLOCK_M + tl.arange(0, BLOCK_M), row_squares)
    tl.debug_barrier()  # every thread's stores precede the ticket, whose release publishes them
    ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLITS - 1
    if last:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        row_squares = tl.zeros([BLOCK_M], tl.float32)
        for split in tl.static_range(SPLITS):
            theirs = tile_ptr + split * (3 * BLOCK_N * BLOCK_M)
            acc += tl.load(theirs + r, cache_modifier=".cg")
            if SWIGLU:
                acc_up += tl.load(theirs + BLOCK_N * BLOCK_M + r, cache_modifier=".cg")
            if NORM:
                row_squares += tl.load(theirs + 2 * BLOCK_N * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
        tl.store(count_ptr + pid_n, 0)
    return acc, acc_up, row_squares, last


def default_config(out_features: int, width: int, norm: bool = False, swiglu: bool = False,
                   rows: int = FOLD_ROWS, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [out_features, width] product: the fastest settings of
    sweeps over the 0.6B and 8B projections and LM heads on an H200 (tune_skinny.py; REPORT "Parts of a step
    (tuners and profilers)", the runs in docs/lab/constants-history.md). A large product (8B) streams W in tiles
    of 64 rows with 4-stage pipelines; the gate/up tiles (two of them, for the SwiGLU) in narrower chunks, an LM
    head too; its settings were picked inside a whole chain of products, where kernels overlap at their
    boundaries. A small one (0.6B, at most SMALL_PRODUCT elements) has too few tiles to fill the GPU whatever
    their size: it takes 64 rows of W per program and shallower pipelines, and default_splits cuts its K. Above
    FOLD_ROWS rows (x padded to 32 or 64; the norm is not folded there) the products take 64 x 128 tiles of W, in
    5 stages (4 above 32 rows for a small product, or gate/up's two tiles), and an LM head above 32 rows
    128 x 64 tiles in 8 warps.

    fp8 (an e4m3 weight): 64 x 128 tiles in 3 stages (4 for gate/up's two tiles up to FOLD_ROWS rows), the
    fastest on the whole of 32 settings at 4 and 64 rows on the 0.6B and 8B projections and LM heads (H200;
    benchmarks/fp8_products.py's docstring). It reads half of bf16's bytes, yet the projections took 0.86-1.44x
    bf16's time at 4 to 64 rows; only the LM heads gained (0.71-0.89x)."""
    if fp8:
        return 64, max(16, min(128, triton.next_power_of_2(width))), 4, 4 if swiglu and rows <= FOLD_ROWS else 3
    if rows > FOLD_ROWS:
        if out_features >= 32768:
            block_n, block_k, warps, stages = (128, 64, 8, 4) if rows > 32 else (64, 128, 4, 4)
        else:  # 4 stages where 5 lost (small products) or do not fit (gate and up tiles beside 64 rows of x)
            four = rows > 32 and (swiglu or out_features * width <= SMALL_PRODUCT)
            block_n, block_k, warps, stages = 64, 128, 4, 4 if four else 5
    elif out_features * width <= SMALL_PRODUCT:
        if swiglu:
            block_n, block_k, warps, stages = 64, 64, 4, 3
        elif norm:
            block_n, block_k, warps, stages = 64, 256, 4, 3
        else:
            block_n, block_k, warps, stages = 64, 128, 4, 4
    elif swiglu:
        block_n, block_k, warps, stages = 64, 64, 4, 4
    elif out_features >= 32768:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    else:
        block_n, block_k, warps, stages = 64, 256, 4, 4
    return block_n, max(16, min(block_k, triton.next_power_of_2(width))), warps, stages


def default_prefetch(out_features: int, width: int, rows: int = FOLD_ROWS) -> int:
    """W's chunks a program of an [out_features, width] product prefetches into L2 before its PDL wait."""
    return PREFETCH_SMALL if rows > FOLD_ROWS or out_features * width <= SMALL_PRODUCT else PREFETCH_LARGE


def prefetch_lines(block_k: int, element_bytes: int) -> dict[str, int]:
    """The kernel's LINES and LINE_ELEMENTS: 128-byte lines in a row of a BLOCK_K chunk of W, and W's elements
    in one line (what _prefetch_first_chunks asks for, one prefetch per line)."""
    return {"LINES": max(1, block_k * element_bytes // 128), "LINE_ELEMENTS": max(1, 128 // element_bytes)}


def row_tile(rows: int) -> int:
    """BLOCK_M: x's rows padded to tl.dot's smallest tile, or to the next power of two above them."""
    return max(MIN_BLOCK_M, triton.next_power_of_2(rows))


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


def stepped_down_configs() -> list[tuple[tuple[int, int, int, int], tuple[int, int, int, int]]]:
    """(setting asked for, setting that fitted) of each product that needed more shared memory than its GPU
    has, so far in this process."""
    return sorted({(key[0], fitted) for key, fitted in _FITTED.items() if key[0] != fitted})


def default_splits(config: tuple[int, int, int, int], tiles: int, chunks: int, swiglu: bool,
                   device: torch.device, block_m: int = MIN_BLOCK_M, weight_bytes: int = 2) -> int:
    """Split-K's ways for a product of `tiles` programs along N and `chunks` BLOCK_K chunks of K at `config`:
    as many as keep every program resident at once (by the shared memory its stages take) and give the GPU
    about SPLIT_PROGRAMS_PER_SM programs per multiprocessor, each with at least MIN_SPLIT_CHUNKS chunks (block_m:
    x's rows as padded, whose chunks share the stages' shared memory with W's tiles). A
    split that needs a second wave of programs loses (an 8B q/k/v at 1 program per multiprocessor: 27 us with
    3 ways against 20 without, H200), so a large setting over many tiles is not split. None on the CPU.
    weight_bytes: bytes of an element of W as it sits in shared memory (1 for e4m3; x's chunks are 16-bit)."""
    if device.type != "cuda":
        return 1
    sms, shared_bytes = _multiprocessors(device)
    block_n, block_k, _, stages = config
    stage_bytes = ((2 if swiglu else 1) * block_n * weight_bytes + block_m * 2) * block_k  # W tile(s), x chunk
    resident = max(1, shared_bytes // (stages * stage_bytes))
    return max(1, min(chunks // MIN_SPLIT_CHUNKS, resident * sms // tiles,
                      -(-SPLIT_PROGRAMS_PER_SM * sms // tiles)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, shared memory bytes per multiprocessor) of a CUDA device."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, getattr(properties, "shared_memory_per_multiprocessor", 228 * 1024)


# Per device: int32 counters, one per tile of W, all 0 between launches (each launch's last programs set
# theirs back). Launches share them: in one stream a launch touches its counters only after the kernel before
# it has finished (stream order, or its wait under PDL: pdl.py), so two launches never use them at once. The
# engine runs its forwards in one stream at a time; two streams running split products together on one
# device would need counters of their own.
_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, tiles: int) -> torch.Tensor:
    counters = _TICKETS.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny's split-K counters must exist before a CUDA graph is captured: run the "
                               "same product once outside the capture first (a warm-up step does).")
        counters = torch.zeros(max(4096, tiles), dtype=torch.int32, device=device)
        _TICKETS[device] = counters
    return counters


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None, swiglu: bool = False,
           config: tuple[int, int, int, int] | None = None,
           splits: int | None = None,
           prefetch: int | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (MIN_ROWS <= M <= MAX_ROWS, contiguous rows) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype.

    norm and swiglu as in gemv(): with norm = (residual or None, norm_weight, eps) the product reads
    weight * rmsnorm(x + residual) and the call returns (y, x + residual); with swiglu, weight is gate rows
    above up rows and y is silu(gate) * up. config: (BLOCK_N, BLOCK_K, num_warps, num_stages), for tuning;
    a setting that needs more shared memory than this GPU has steps down (smaller_config) until one fits.
    splits: split-K's ways (None: default_splits); K is cut into that many ranges of whole BLOCK_K chunks.
    prefetch: W's chunks each program asks into L2 before its PDL wait (None: default_prefetch; 0: none).
    weight_scale: float32 [N] (with swiglu, [2I]) for a float8_e4m3fn weight, read as fp8 and widened to x's
    dtype for the tensor cores; each row's scale multiplies its float32 products before the bias and the
    SwiGLU (fp8_linear.py). Needs e4m3 in hardware on a GPU (compute capability 8.9 or later).
    """
    rows, width = x.shape
    if not MIN_ROWS <= rows <= MAX_ROWS or weight.shape[1] != width or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny takes x [{MIN_ROWS} <= M <= {MAX_ROWS}, K] and weight [N, K] with contiguous "
                         f"rows; got {tuple(x.shape)} (strides {x.stride()}) and {tuple(weight.shape)} (strides "
                         f"{weight.stride()}).")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits is a whole number of at least 1 (or None for the default), got {splits!r}.")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
        raise ValueError(f"prefetch is a whole number of W's chunks, 0 or more (or None for the default), got "
                         f"{prefetch!r}.")
    check_weight_scale(weight, weight_scale)
    out_features = check_folds(x, weight, norm, swiglu)
    residual, norm_weight, eps = norm if norm is not None else (None, None, 0.0)
    y = x.new_empty(rows, out_features)
    summed = torch.empty_like(x) if residual is not None else None
    requested = config or default_config(out_features, width, norm is not None, swiglu, rows, weight_scale is not None)
    # Shared memory depends on all of these.
    key = (requested, x.dtype, weight.dtype, x.device, norm is not None, swiglu, row_tile(rows))
    config = _FITTED.get(key, requested)
    while True:
        try:
            _launch(config, splits, prefetch, x, residual, norm_weight, summed, weight, weight_scale, bias, y, eps,
                    norm is not None, swiglu)
            break
        except OutOfResources:
            config = smaller_config(config)
            if config is None:
                raise
    _FITTED[key] = config
    if norm is None:
        return y
    return y, (summed if summed is not None else x)


def _launch(config, splits, prefetch, x, residual, norm_weight, summed, weight, weight_scale, bias, y, eps,
            norm: bool, swiglu: bool) -> None:
    block_n, block_k, warps, stages = config
    rows, width = x.shape
    out_features = y.shape[1]
    tiles, chunks = triton.cdiv(out_features, block_n), triton.cdiv(width, block_k)
    block_m = row_tile(rows)
    prefetch = default_prefetch(out_features, width, rows) if prefetch is None else prefetch
    splits = min(splits or default_splits(config, tiles, chunks, swiglu, x.device, block_m,
                                          1 if weight_scale is not None else 2), chunks)
    chunks_per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, chunks_per_split)  # no split left without columns
    if splits > 1:
        partials = torch.empty(tiles * splits * 3 * block_n * block_m, dtype=torch.float32, device=x.device)
        tickets = _tickets(x.device, tiles)
    else:
        partials = tickets = y  # never read
    _skinny_kernel[(tiles, splits)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        summed if summed is not None else y, weight, weight_scale if weight_scale is not None else y,
        bias if bias is not None else weight, y, partials, tickets,
        rows, out_features, width, chunks_per_split * block_k,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        summed.stride(0) if summed is not None else 0, weight.stride(0), y.stride(0), eps,
        HAS_BIAS=bias is not None, NORM=norm, RESIDUAL=residual is not None, SWIGLU=swiglu,
        HAS_SCALE=weight_scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PREFETCH=min(prefetch, chunks_per_split),
        **prefetch_lines(block_k, weight.element_size()),
        num_warps=warps, num_stages=stages,
        **pdl_arguments(x))
