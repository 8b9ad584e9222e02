"""The model's matrix products, each sent to the kernel that runs its number of rows fastest, with the RMSNorm
before it and the SwiGLU after it folded in where that kernel can fold them.

- 1 row (a one-leaf decode step): gemv.py. At one row it beats cuBLAS on every 0.6B projection (o_proj 4.7
  against 12.8 us on an H200, L2 flushed); each extra row costs it a pass over W from L2 (at 4 rows q/k/v
  took 10.4 us against cuBLAS's 5.9), so it takes only one.
- 2 to SKINNY_ROWS rows (a batch of leaves): skinny.py, on tensor cores, with the same folds up to
  skinny.FOLD_ROWS rows; above that, the norm runs as its own kernel and only the SwiGLU folds.
- more (prefill, large batches): cuBLAS, with the norm and the SwiGLU as their own kernels (captured
  through cuBLASLt inside decode graphs: cuda_graphs.py).

Skinny only where its launches cost the host nothing: in a forward that a CUDA graph captures (graph_products(),
around the capture and its warm-up) or on the CPU (the interpreter's tests). A step that runs eagerly on a GPU
(cuda_graphs=False, or the FlashInfer backend, which graphs refuse) is bound by the host's launches, and a launch
of skinny costs the host more than cuBLAS's. On three H200 machines, alternating, cuBLAS ran the eager steps
faster in 29 pairs of 33 (benchmarks/eager_products.py). Examples: the 8B model at 64 rows with FlashInfer's
attention took 14.2-17.0 ms against 17.3-20.6, and the 0.6B at 5 rows 12.5-13.9 against 16.1-21.0. Inside
graphs, skinny won every pair (8B at 5 rows: 4.63 against 5.15 ms; 0.6B: 1.02 against 1.28).
gemv keeps one row eagerly too: there it beat cuBLAS with its separate norm and SwiGLU kernels (decode step
(b) 10.1-11.1 against 11.9 ms).

docs/lab/gpu-fast-path.md (seventh, thirteenth and fourteenth sessions) has the measurements behind the row limits.

FP8 weights (weight_scale given: the weight is float8_e4m3fn [N, K], weight_scale float32 [N], and W stands
for weight_scale[:, None] * weight): the same kernels by rows. A decode step's few rows are bound by the
weight's bytes, so gemv and skinny read the fp8 weight directly, half of bf16's bytes, with x at full
precision and each output column's scale applied to its float32 sum; at these rows they already beat cuBLAS
(above), and on an H200 they beat torch._scaled_mm's path at 1-16 rows on every projection of the 0.6B and 8B
models but the 8B gate/up at 4 and 16 rows (fp8_linear.py). Beyond them, and in eager GPU steps, where cuBLAS
ran the bf16 products, a product is bound by tensor-core time and launches, and fp8_linear.py hands it to the
library: torch._scaled_mm with x quantised per row to e4m3, or on the CPU and GPUs without e4m3 (compute
capability below 8.9, where Triton cannot convert e4m3 either) a float32 F.linear of the widened weight.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F

from ..kv.fp8 import FP8_DTYPE
from .fp8_linear import fp8_linear, has_e4m3
from .gemv import gemv
from .norm import add_rms_norm
from .skinny import FOLD_ROWS, MIN_ROWS, skinny
from .swiglu import silu_mul

GEMV_ROWS = 1  # the most rows sent to gemv
SKINNY_ROWS = 64  # the most rows sent to skinny (at most skinny.MAX_ROWS)
# The most rows whose product over an fp8 weight skinny takes; more go to fp8_linear (x quantised to e4m3 in
# one launch, torch._scaled_mm), in graphs too.
FP8_SKINNY_ROWS = SKINNY_ROWS
_graph_depth = 0  # graph_products() blocks entered and not yet left


@contextlib.contextmanager
def graph_products():
    """Inside this block the forward is one that a CUDA graph captures (or its warm-up): few-row products go
    to skinny, whose launches the graph replays for free. Outside it, on a GPU, they go to cuBLAS."""
    global _graph_depth
    _graph_depth += 1
    try:
        yield
    finally:
        _graph_depth -= 1


def in_graph_forward() -> bool:
    """Whether the forward running now is one that a CUDA graph captures, or its warm-up (inside
    graph_products()): what the tensor-parallel all-reduces also go by (distributed/peer_memory.py)."""
    return _graph_depth > 0


def product_kernel(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which kernel runs x @ weight.T here: "gemv", "skinny" or "cublas" (on a GPU, "skinny" only inside
    graph_products(): an eager step sends its 2-64 rows to cuBLAS). "cublas" stands for the library's product:
    F.linear, or for an fp8 weight fp8_linear (which is the only one for fp8 on a GPU without e4m3)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.stride(1) != 1:
        return "cublas"
    if weight.dtype == FP8_DTYPE and x.is_cuda and not has_e4m3(x.device):
        return "cublas"
    rows = x.shape[0]
    if rows <= GEMV_ROWS:
        return "gemv"
    eager_gpu = x.is_cuda and not _graph_depth
    most = FP8_SKINNY_ROWS if weight.dtype == FP8_DTYPE and has_e4m3(x.device) else SKINNY_ROWS
    return "skinny" if MIN_ROWS <= rows <= most and not eager_gpu else "cublas"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through gemv or skinny for a decode step of few rows. With weight_scale, weight is fp8 and
    the product is x @ (weight_scale[:, None] * weight.float()).T, in float32, cast to x's dtype, bias added
    after the scale."""
    kernel = product_kernel(x, weight)
    if kernel == "gemv":
        return gemv(x, weight, bias, weight_scale=weight_scale)
    if kernel == "skinny":
        return skinny(x, weight, bias, weight_scale=weight_scale)
    if weight_scale is not None or weight.dtype == FP8_DTYPE:
        return fp8_linear(x, weight, weight_scale, bias)
    return F.linear(x, weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(weight * rmsnorm(x + residual)), x + residual); x itself is the stream when residual is None.
    One kernel for a decode step of up to FOLD_ROWS rows; otherwise the norm's own kernel, then linear().
    weight_scale: for an fp8 weight, as linear() takes it."""
    kernel = product_kernel(x, weight)
    if kernel == "gemv":
        return gemv(x, weight, bias, norm=(residual, norm_weight, eps), weight_scale=weight_scale)
    if kernel == "skinny" and x.shape[0] <= FOLD_ROWS:
        return skinny(x, weight, bias, norm=(residual, norm_weight, eps), weight_scale=weight_scale)
    normed, summed = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias, weight_scale=weight_scale), summed


def linear_silu_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                    norm: tuple[torch.Tensor | None, torch.Tensor, float], *,
                    weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up of the stacked gate_up projection of weight * rmsnorm(x + residual), x + residual) for
    norm = (residual, weight, eps), as norm_linear returns them. One kernel for a decode step of up to FOLD_ROWS
    rows; then the norm's own kernel and skinny with the SwiGLU, up to SKINNY_ROWS; cuBLAS and two kernels beyond,
    and wherever product_kernel picks cuBLAS (an eager step on a GPU). weight_scale: for an fp8 gate_up weight,
    float32 [2I] (gate rows' scales above up rows'), each applied before silu(gate) * up."""
    kernel = product_kernel(x, gate_up_weight)
    if kernel == "gemv":
        return gemv(x, gate_up_weight, gate_up_bias, norm=norm, swiglu=True, weight_scale=weight_scale)
    if kernel == "skinny":
        if x.shape[0] <= FOLD_ROWS:
            return skinny(x, gate_up_weight, gate_up_bias, norm=norm, swiglu=True, weight_scale=weight_scale)
        normed, summed = add_rms_norm(x, *norm)
        return skinny(normed, gate_up_weight, gate_up_bias, swiglu=True, weight_scale=weight_scale), summed
    gate_up, summed = norm_linear(x, norm[0], norm[1], norm[2], gate_up_weight, gate_up_bias,
                                  weight_scale=weight_scale)
    return silu_mul(gate_up), summed

