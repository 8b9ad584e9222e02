"""kernels/row_quantize.py: rows of x to e4m3 with a float32 scale each, in one launch, against kv/fp8.quantize.

Without CUDA the kernel runs in Triton's interpreter, whose float32 -> e4m3 conversion is wrong whenever rounding
carries into the exponent (126.4 becomes 64, not 128; test_fp8_kv.py), so there the rows hold values that need no
rounding once scaled: e4m3 values times the row's scale. The `gpu` test checks arbitrary bfloat16 rows.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before the import below

pytest.importorskip("triton")

from dendrite_nb.kernels import row_quantize as row_quantize_module  # noqa: E402
from dendrite_nb.kernels.row_quantize import row_quantize  # noqa: E402
from dendrite_nb.kv.fp8 import FP8_DTYPE, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def exact_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """float32 rows of e4m3 normals (each row reaching 448 once) times a power of two per row, 2^-10 to 2^10,
    so the row's scale is that power of two and x / scale is exact."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.empty(rows, width).uniform_(-6, 8.8, generator=generator))
    signs = torch.randint(0, 2, (rows, width), generator=generator) * 2 - 1
    values = (signs * magnitudes).to(FP8_DTYPE).float()
    values[:, width // 3] = -448.0
    powers = torch.exp2(torch.linspace(-10, 10, rows).round())
    return (values * powers[:, None]).to(DEVICE)


@pytest.mark.parametrize("rows,width", [(1, 16), (5, 200), (3, 4100)])
def test_row_quantize_gives_the_bytes_and_scales_of_the_torch_quantiser(rows, width, monkeypatch):
    """Widths under one block, several blocks with a partial last one (BLOCK_K made small), and one over the
    default block: the same scales bit for bit and the same e4m3 values."""
    monkeypatch.setattr(row_quantize_module, "BLOCK_K", 64)
    x = exact_rows(rows, width, seed=width)
    got, got_scales = row_quantize(x)
    want, want_scales = quantize(x)
    assert got.dtype == FP8_DTYPE and got.shape == x.shape and got_scales.shape == (rows,)
    assert torch.equal(got_scales, want_scales)
    assert torch.equal(got.float(), want.float())


def test_an_all_zero_row_gets_the_smallest_scale_and_zeros():
    x = torch.zeros(2, 40, device=DEVICE)
    x[1, 3] = 7.0
    got, scales = row_quantize(x)
    want, want_scales = quantize(x)
    assert torch.equal(scales, want_scales) and scales[0] > 0
    assert torch.equal(got.float(), want.float())


def test_row_quantize_refuses_rows_that_are_not_contiguous():
    with pytest.raises(ValueError, match="contiguous rows"):
        row_quantize(torch.zeros(8, 4, device=DEVICE).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_row_quantize_matches_torch_on_arbitrary_bfloat16_rows_on_cuda():
    x = (torch.randn(64, 14336, device="cuda") * torch.logspace(-2, 2, 64, device="cuda")[:, None]).bfloat16()
    got, scales = row_quantize(x)
    want, want_scales = quantize(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(got.float(), want.float())
