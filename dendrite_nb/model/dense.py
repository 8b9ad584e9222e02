"""The reference model's linear layers, with the few-row products of a CPU decode step taken the fast way round.

On a CPU, MKL computes a float32 product of 2 to 64 rows against a large weight faster as W @ x.T than as
x @ W.T (F.linear): the weight, which is what the product has to stream from memory, is then the left operand
in its stored order. Measured on the CI machine (2 cores, AVX-512), rows 5: the 0.6B LM head (151,936 x 1,024)
52 ms against 120, a 0.6B layer stack's products 156 ms against 203; at one row both take the same GEMV path
(benchmarks/cpu_decode.py has the whole step). Prefill chunks (hundreds of rows) and other devices and dtypes
keep F.linear.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .quantized_linear import QuantizedLinear

MIN_ROWS, MAX_ROWS = 2, 64  # the decode batches this was measured over


def dense(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x [rows, in_features] -> [rows, out_features], contiguous."""
    if isinstance(layer, QuantizedLinear):  # its own products, chosen by device and rows
        return layer(x)
    weight = layer.weight
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and MIN_ROWS <= x.shape[0] <= MAX_ROWS):
        return F.linear(x, weight, layer.bias)
    out = torch.mm(weight, x.t()).t().contiguous()  # the copy is rows x out_features: small beside the weight
    return out if layer.bias is None else out.add_(layer.bias)
