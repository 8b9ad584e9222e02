"""model/dense.py: the reference model's products, few rows on a CPU taken as W @ x.T, equal F.linear."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dendrite_nb.model.dense import MAX_ROWS, MIN_ROWS, dense


@pytest.mark.parametrize("rows", [1, MIN_ROWS, 5, MAX_ROWS, MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_equals_linear_at_every_row_count(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    got = dense(layer, x)
    assert got.shape == (rows, 200) and got.is_contiguous()
    assert (got - F.linear(x, layer.weight, layer.bias)).abs().max() < 1e-5
    if not MIN_ROWS <= rows <= MAX_ROWS:   # outside the measured range it is F.linear itself
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


def test_other_dtypes_keep_linear():
    layer = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(dense(layer, x), F.linear(x, layer.weight, layer.bias))
