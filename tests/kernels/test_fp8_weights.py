"""Products with fp8 weights (float8_e4m3fn [N, K] and a float32 scale per output channel): gemv, skinny and
the library path of kernels/fp8_linear.py, each against x @ (scale[:, None] * w8.float()).T.

Without CUDA the Triton kernels run in the interpreter, in float32. The interpreter loads float8_e4m3fn
pointers and widens every finite e4m3 value exactly (it reads the two NaN codes, never in a quantised weight,
as +-480), so the kernels load the weight as fp8 here as on a GPU. The `gpu` tests add bfloat16 activations,
torch._scaled_mm on the GPU and the eager dispatch there.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before the import below

pytest.importorskip("triton")

from torch.nn import functional as F  # noqa: E402

from dendrite_nb import kernels  # noqa: E402
from dendrite_nb.kernels import fp8_linear as fp8_module  # noqa: E402
from dendrite_nb.kernels.products import graph_products  # noqa: E402
from dendrite_nb.kv.fp8 import quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT32_TOL, BF16_TOL = 1e-5, 1e-2  # max error over the largest reference value, as test_fused_kernels.py
EPS = 1e-6
CONFIG = (16, 64, 4, 2)  # several programs along N, several K chunks, a partial last one (K = 200)
pytestmark = pytest.mark.usefixtures("exact_float32_matmuls")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def random(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def fp8_weight(out_features: int, width: int, seed: int = 3, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8 [N, K] e4m3, scale [N] float32), quantised per row from a random weight whose rows' magnitudes span
    1e-2 to 1e2 in shuffled order, so that a scale applied to the wrong row, or the gate's to the up half of a
    stacked weight, shows."""
    magnitudes = torch.logspace(-2, 2, out_features)[torch.randperm(out_features,
                                                                    generator=torch.Generator().manual_seed(seed))]
    w8, scale = quantize(random(out_features, width, seed=seed, device="cpu") * magnitudes[:, None])
    return w8.to(device), scale.to(device)


def dequantized(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scale[:, None] * w8.float()


def reference(x, w8, scale, bias=None, norm=None, swiglu=False):
    """(y, stream): the float32 product x @ dequantised W.T (+ bias), with the norm before it (weight *
    rmsnorm(x + residual), as RMSNorm computes it in float32) and silu(gate) * up after it."""
    stream = x if norm is None or norm[0] is None else x + norm[0]
    inputs = stream
    if norm is not None:
        inputs = norm[1] * (stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + EPS))
    y = F.linear(inputs.float(), dequantized(w8, scale), None if bias is None else bias.float())
    if swiglu:
        half = y.shape[-1] // 2
        y = F.silu(y[..., :half]) * y[..., half:]
    return y.to(x.dtype), stream


def problem(rows: int, residual: bool, bias: bool, width: int = 200, out_features: int = 96):
    """x [rows, width] and, for the folds, residual, norm weight; the fp8 weight and its scale; a bias."""
    x = random(rows, width) * 3
    norm = (random(rows, width, seed=1) if residual else None, 1 + 0.1 * random(width, seed=2), EPS)
    w8, scale = fp8_weight(out_features, width)
    return x, norm, w8, scale, (random(out_features, seed=4) if bias else None)


# ---- the kernels, float32 activations (the interpreter without CUDA) ------------------------------------------
@pytest.mark.parametrize("rows,with_bias", [(1, False), (1, True), (4, True)])
def test_gemv_reads_fp8_weights_like_the_dequantised_product(rows, with_bias):
    x, _, w8, scale, bias = problem(rows, False, with_bias)
    expected, _ = reference(x, w8, scale, bias)
    assert rel_err(kernels.gemv(x, w8, bias, weight_scale=scale, config=CONFIG), expected) < FLOAT32_TOL
    assert rel_err(kernels.gemv(x, w8, bias, weight_scale=scale), expected) < FLOAT32_TOL  # default settings


@pytest.mark.parametrize("rows,with_residual,with_bias", [(1, True, False), (3, False, True)])
def test_gemv_folds_the_norm_and_swiglu_with_each_row_scaled_before_them(rows, with_residual, with_bias):
    x, norm, w8, scale, bias = problem(rows, with_residual, with_bias)
    product, stream = kernels.gemv(x, w8, bias, norm=norm, config=CONFIG, weight_scale=scale)
    expected, expected_stream = reference(x, w8, scale, bias, norm)
    assert rel_err(product, expected) < FLOAT32_TOL and torch.equal(stream, expected_stream)
    swiglu, stream = kernels.gemv(x, w8, bias, norm=norm, swiglu=True, config=CONFIG, weight_scale=scale)
    expected, _ = reference(x, w8, scale, bias, norm, swiglu=True)
    assert rel_err(swiglu, expected) < FLOAT32_TOL and torch.equal(stream, expected_stream)


@pytest.mark.parametrize("rows,with_residual,with_bias", [(2, True, False), (5, False, True), (16, True, True),
                                                          (40, False, True)])  # 40: x padded to 64 rows
def test_skinny_reads_fp8_weights_with_and_without_the_folds(rows, with_residual, with_bias):
    x, norm, w8, scale, bias = problem(rows, with_residual, with_bias)
    expected, expected_stream = reference(x, w8, scale, bias)
    assert rel_err(kernels.skinny(x, w8, bias, config=CONFIG, weight_scale=scale), expected) < FLOAT32_TOL
    assert rel_err(kernels.skinny(x, w8, bias, weight_scale=scale), expected) < FLOAT32_TOL  # default settings
    swiglu = kernels.skinny(x, w8, bias, swiglu=True, config=CONFIG, weight_scale=scale)
    assert rel_err(swiglu, reference(x, w8, scale, bias, swiglu=True)[0]) < FLOAT32_TOL
    for with_swiglu in (False, True):
        folded, stream = kernels.skinny(x, w8, bias, norm=norm, swiglu=with_swiglu, config=CONFIG,
                                        weight_scale=scale)
        expected, expected_stream = reference(x, w8, scale, bias, norm, with_swiglu)
        assert rel_err(folded, expected) < FLOAT32_TOL and torch.equal(stream, expected_stream)


def test_skinny_split_k_scales_the_summed_partials_and_repeats_bit_for_bit():
    """Split-K with an fp8 weight (3 ways asked over K's 4 chunks of 64: 2 ways of 2 chunks, the last partial):
    the last program of a tile adds the partials in split order, then applies the scales, so a second call
    gives the same bits."""
    x, norm, w8, scale, bias = problem(5, True, True)
    product, _ = kernels.skinny(x, w8, bias, norm=norm, swiglu=True, config=CONFIG, splits=3, weight_scale=scale)
    assert rel_err(product, reference(x, w8, scale, bias, norm, swiglu=True)[0]) < FLOAT32_TOL
    again, _ = kernels.skinny(x, w8, bias, norm=norm, swiglu=True, config=CONFIG, splits=3, weight_scale=scale)
    assert torch.equal(again, product)


# ---- the dispatch and the library path ---------------------------------------------------------------------------
def test_products_send_fp8_weights_to_gemv_skinny_or_the_library_by_rows():
    """As a captured forward dispatches them: gemv at 1 row, skinny (folding the norm up to 16 rows) to 64, and
    fp8_linear beyond (on the CPU its float32 F.linear of the widened weight)."""
    width = 200
    w8, scale = fp8_weight(96, width)
    bias, norm_weight = random(96, seed=4), 1 + 0.1 * random(width, seed=2)
    with graph_products():
        for rows, kernel in ((1, "gemv"), (9, "skinny"), (17, "skinny"), (65, "cublas")):
            x, residual = random(rows, width) * 3, random(rows, width, seed=1)
            assert kernels.product_kernel(x, w8) == kernel
            norm = (residual, norm_weight, EPS)
            assert rel_err(kernels.linear(x, w8, bias, weight_scale=scale), reference(x, w8, scale, bias)[0]) \
                < FLOAT32_TOL
            product, stream = kernels.norm_linear(x, residual, norm_weight, EPS, w8, bias, weight_scale=scale)
            expected, expected_stream = reference(x, w8, scale, bias, norm)
            assert rel_err(product, expected) < FLOAT32_TOL and torch.equal(stream, expected_stream)
            swiglu, stream = kernels.linear_silu_mul(x, w8, bias, norm, weight_scale=scale)
            expected, _ = reference(x, w8, scale, bias, norm, swiglu=True)
            assert rel_err(swiglu, expected) < FLOAT32_TOL and torch.equal(stream, expected_stream)
        x = random(2, 7, width)  # a prefill's [batch, tokens, K]: the library's product keeps the leading axes
        assert rel_err(kernels.linear(x, w8, bias, weight_scale=scale), reference(x, w8, scale, bias)[0]) \
            < FLOAT32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fallback_widens_the_weight_a_chunk_of_rows_at_a_time(dtype, monkeypatch):
    """On the CPU (and GPUs without e4m3): float32 products of at most DEQUANTIZED_CHUNK_BYTES of widened weight,
    here 13 rows of 200 columns, so 96 rows take 8 chunks, the last one partial; one rounding to x's dtype."""
    monkeypatch.setattr(fp8_module, "DEQUANTIZED_CHUNK_BYTES", 13 * 200 * 4)
    w8, scale = fp8_weight(96, 200, device="cpu")
    x, bias = random(70, 200, dtype=dtype, device="cpu"), random(96, seed=4, dtype=dtype, device="cpu")
    got = fp8_module.dequantized_linear(x, w8, scale, bias)
    expected = (x.float() @ dequantized(w8, scale).T + bias.float()).to(dtype)
    assert rel_err(got, expected) < (FLOAT32_TOL if dtype == torch.float32 else 2 ** -8)


def scaled_mm_errors(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each row's relative error of fp8_linear's _scaled_mm product against the float32 reference."""
    got = fp8_module.scaled_mm_linear(x, w8, scale, bias)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w8.shape[0])
    expected = x.float() @ dequantized(w8, scale).T + bias.float()
    return (got.float() - expected).norm(dim=1) / expected.norm(dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_scaled_mm_path_quantises_each_row_of_x_on_its_own(dtype):
    """torch._scaled_mm's row-wise scales, as fp8_linear passes them, on torch's CPU implementation: rows of x
    a million times apart in magnitude each keep e4m3's relative precision (one scale for all of x would
    flush the small rows), and each output column gets its own weight scale. The bias is fused in bf16 and
    added afterwards for float32 (the library refuses a float32 output's bias)."""
    w8, scale = fp8_weight(96, 208, device="cpu")
    x = (random(7, 208, device="cpu") * torch.logspace(-3, 3, 7)[:, None]).to(dtype)
    bias = random(96, seed=4, dtype=dtype, device="cpu") * 1e-3
    try:
        errors = scaled_mm_errors(x, w8, scale, bias)
    except (RuntimeError, NotImplementedError) as missing:
        pytest.skip(f"this torch has no CPU _scaled_mm with row-wise scales: {missing}")
    # e4m3 rounds each element of x within 2^-4 of itself: 2-5% per row here (a few rows of the weight dominate
    # every output row); a scale on the wrong row or column, or one scale for all of x, gives 100% or more.
    assert errors.max() < 0.1, errors


@pytest.mark.parametrize("capability,has", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                            ((12, 1), True)])
def test_fp8_weights_use_e4m3_hardware_only_where_the_gpu_has_it(capability, has, monkeypatch):
    """Below compute capability 8.9 (A100, RTX 30xx) Triton cannot convert e4m3 and torch._scaled_mm refuses:
    has_e4m3 says so, and product_kernel and fp8_linear ask it before using either (sending the products to
    the widened-weight fallback there)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fp8_module.has_e4m3.__wrapped__(torch.device("cuda")) is has
    assert fp8_module.has_e4m3.__wrapped__(torch.device("cpu")) is False


# ---- bad input ---------------------------------------------------------------------------------------------------
def bad_pairs():
    """(weight, weight_scale, message) that no product takes."""
    w8, scale = fp8_weight(32, 64)
    return [
        (w8.float(), scale, (r"a weight_scale was given, so the weight must be torch.float8_e4m3fn \[N, K\]; got "
                             r"torch.float32 \(32, 64\)")),
        (w8, None, (r"the weight \(32, 64\) is torch.float8_e4m3fn but no weight_scale was given; pass its float32 "
                    r"scale per output channel, weight_scale \[32\]")),
        (w8, scale[:31], r"weight_scale is torch.float32 \(31,\) .*expected a contiguous float32 \[32\]"),
        (w8, scale.double(), r"weight_scale is torch.float64 \(32,\)"),
        (w8, scale[:, None], r"weight_scale is torch.float32 \(32, 1\)"),
        (w8, torch.stack([scale, scale], 1)[:, 0], r"\(stride \(2,\)\); expected a contiguous"),
    ]


@pytest.mark.parametrize("case", range(len(bad_pairs())))
def test_every_product_refuses_a_weight_and_scale_that_do_not_match(case):
    weight, weight_scale, message = bad_pairs()[case]
    norm = (None, random(64, seed=2), EPS)
    calls = [lambda x: kernels.gemv(x, weight, weight_scale=weight_scale),
             lambda x: kernels.gemv(x, weight, norm=norm, swiglu=True, weight_scale=weight_scale),
             lambda x: kernels.skinny(x.expand(2, -1).contiguous(), weight, weight_scale=weight_scale)]
    with graph_products():
        for rows in (1, 5, 17, 65):
            calls += [lambda x, rows=rows: kernels.linear(x.expand(rows, -1).contiguous(), weight,
                                                          weight_scale=weight_scale),
                      lambda x, rows=rows: kernels.norm_linear(x.expand(rows, -1).contiguous(), None, norm[1], EPS,
                                                               weight, weight_scale=weight_scale),
                      lambda x, rows=rows: kernels.linear_silu_mul(x.expand(rows, -1).contiguous(), weight, None,
                                                                   norm, weight_scale=weight_scale)]
        calls.append(lambda x: fp8_module.fp8_linear(x, weight, weight_scale))
        for call in calls:
            with pytest.raises(ValueError, match=message):
                call(random(1, 64))


def test_fp8_linear_refuses_a_weight_of_another_dtype_or_width():
    w8, scale = fp8_weight(32, 64)
    with pytest.raises(ValueError, match="fp8_linear multiplies by fp8 weights; this one is torch.float32"):
        fp8_module.fp8_linear(random(3, 64), w8.float(), None)
    with pytest.raises(ValueError, match=r"x has 60 features per row but the weight \(32, 64\) takes 64"):
        fp8_module.fp8_linear(random(3, 60), w8, scale)


# ---- on a GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_matches_the_reference_at_prefill_and_eager_rows_on_cuda(dtype, monkeypatch):
    """Outside graph_products() a GPU sends 2..64 rows, and everything above, to fp8_linear: torch._scaled_mm on
    a GPU with e4m3, x quantised per row; a bias fused (bf16) or added after (float32). Widths of real models."""
    if not fp8_module.has_e4m3(torch.device("cuda")):
        pytest.skip("torch._scaled_mm needs compute capability 8.9 or later")
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: calls.append(1) or scaled_mm(*args, **kwargs))
    w8, scale = fp8_weight(4096, 1024, device="cuda")
    bias = random(4096, seed=4, dtype=dtype, device="cuda")
    for rows in (5, 64, 300, 4096):
        x = (random(rows, 1024, dtype=dtype, device="cuda") * torch.logspace(-2, 2, rows, device="cuda")[:, None]
             ).to(dtype)
        assert kernels.product_kernel(x, w8) == "cublas"
        got = kernels.linear(x, w8, bias, weight_scale=scale)
        expected = x.float() @ dequantized(w8, scale).T + bias.float()
        errors = (got.float() - expected).norm(dim=1) / expected.norm(dim=1)
        assert got.dtype == dtype and errors.max() < 0.05, (rows, errors.max())
    assert len(calls) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 40])
def test_fp8_kernels_match_the_reference_in_bfloat16_on_cuda(rows):
    """gemv and skinny with bf16 activations (the interpreter does float32 only) at Qwen3-0.6B's q/k/v and
    gate/up widths, folds on, as a captured decode step runs them; and the bf16 product without folds."""
    if not fp8_module.has_e4m3(torch.device("cuda")):
        pytest.skip("Triton's e4m3 needs compute capability 8.9 or later")
    width = 1024
    x = random(rows, width, dtype=torch.bfloat16, device="cuda")
    residual = random(rows, width, seed=1, dtype=torch.bfloat16, device="cuda")
    norm = (residual, (1 + 0.1 * random(width, seed=2, device="cuda")).to(torch.bfloat16), EPS)
    w8, scale = fp8_weight(6144, width, device="cuda")
    with graph_products():
        for swiglu in (False, True):
            got, stream = (kernels.linear_silu_mul(x, w8, None, norm, weight_scale=scale) if swiglu else
                           kernels.norm_linear(x, residual, norm[1], EPS, w8, weight_scale=scale))
            expected, expected_stream = reference(x.float(), w8, scale, None,
                                                  (residual.float(), norm[1].float(), EPS), swiglu)
            assert rel_err(got.float(), expected) < BF16_TOL and rel_err(stream.float(), expected_stream) < BF16_TOL
        got = kernels.linear(x, w8, weight_scale=scale)
        assert rel_err(got.float(), reference(x.float(), w8, scale)[0]) < BF16_TOL
