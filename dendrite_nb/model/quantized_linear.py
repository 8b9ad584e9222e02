"""A linear layer whose weight is stored quantized (model/quantize.py), and the choice of format per device.

`Engine.from_pretrained(..., weights="int8" | "int4" | "fp8")` loads the model in its dtype, then
`quantize_model` replaces every projection and the LM head with a QuantizedLinear, one layer at a time (the
embedding stays in the model's dtype: a step reads one row of it per token). Activations keep the model's dtype.

Which kernel runs a product, by device and format:
- CPU, int8 and int4: torch's packed weight-only products (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`).
  They take bfloat16 activations (their float32 path is a slow reference loop: 114 against 15 ms for SmolLM2's
  products at one row on the 2-core CI machine), so a float32 model's rows are rounded to bfloat16 for them
  and the result cast back. They win at few rows and lose at many (they are not blocked for reuse): at 1,536 x 576,
  5 rows took 0.26 ms against float32's 0.36, 64 rows 2.37 against 1.06, 512 rows 16.6 against 8.1. Above
  DEQUANTIZE_ABOVE_ROWS rows (prefill chunks, wide batches) the weight is dequantized for that product and
  float32's GEMM runs it.
- CUDA, fp8: the fused kernels' products read the fp8 weight and its per-channel scale (kernels/products.py:
  gemv and skinny for decode steps, torch._scaled_mm beyond).
Other pairs raise UnsupportedWeights before anything loads (check_weights).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import DendriteError
from . import quantize

WEIGHT_FORMATS = ("int8", "int4", "fp8")
# Formats with a fast product on each device type (see the module docstring).
SUPPORTED = {"cpu": ("int8", "int4"), "cuda": ("fp8",)}
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: e4m3 tensor-core products (torch._scaled_mm)
DEQUANTIZE_ABOVE_ROWS = 32  # CPU: more rows than this run as a float32 GEMM over the dequantized weight
_CPU_COMPUTE_DTYPE = torch.bfloat16  # what torch's CPU packed products take


class UnsupportedWeights(DendriteError, ValueError):
    """A weights format the engine cannot run on the chosen device."""


def check_weights(weights: str | None, device: torch.device) -> None:
    """Raise UnsupportedWeights unless `weights` (None: the model's dtype) runs fast on `device`."""
    if weights is None:
        return
    if weights not in WEIGHT_FORMATS:
        raise UnsupportedWeights(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))} or None (the "
                                 f"model's dtype), got {weights!r}.")
    supported = SUPPORTED.get(device.type, ())
    if weights not in supported:
        choices = "; ".join(f"{kind}: {', '.join(formats)}" for kind, formats in SUPPORTED.items())
        raise UnsupportedWeights(f"weights={weights!r} has no fast product on {device.type} in dendrite-nb "
                                 f"({choices}); pick one of those for this device, or weights=None.")
    if weights == "fp8" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UnsupportedWeights(f"weights='fp8' needs an Ada or Hopper GPU or newer (compute capability 8.9+); "
                                 f"{name} is {torch.cuda.get_device_capability(device)}. Use weights=None.")


class QuantizedLinear(nn.Module):
    """y = x @ W.T + bias with W held as `format` (buffers: `qweight`, `scale`, and int4's `zero` and
    `packed`). Built by QuantizedLinear.from_linear."""

    def __init__(self, format: str, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.format, self.in_features, self.out_features = format, in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str, absmax: torch.Tensor | None = None) -> QuantizedLinear:
        """absmax: int8's and fp8's per-channel magnitudes to scale by (quantize.quantize_int8); int4's groups
        take their own."""
        weight = linear.weight.detach()
        layer = cls(format, linear.in_features, linear.out_features, linear.bias)
        layer.dtype = weight.dtype  # the activations' dtype, which products return
        if format == "int8":
            q, scale = quantize.quantize_int8(weight, absmax)
            layer.register_buffer("qweight", q)
            layer.register_buffer("scale", scale)
        elif format == "int4":
            q, scale, zero = quantize.quantize_int4(weight)
            layer.register_buffer("qweight", quantize.pack_nibbles(q))  # [N, K // 2]: the dequantizing products
            layer.register_buffer("scale", scale)
            layer.register_buffer("zero", zero)
            if weight.device.type == "cpu":  # the kernel's own tiled layout, and its [groups, N, 2] scales
                layer.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
                layer.register_buffer("scale_and_zero", torch.stack([scale.t(), zero.t()], dim=2)
                                      .to(_CPU_COMPUTE_DTYPE).contiguous())
        elif format == "fp8":
            w8, scale = quantize.quantize_fp8(weight, absmax)
            layer.register_buffer("qweight", w8)
            layer.register_buffer("scale", scale)
        else:
            raise UnsupportedWeights(f"unknown weights format {format!r}; expected one of {WEIGHT_FORMATS}.")
        if format == "int8" and weight.device.type == "cpu":
            layer.register_buffer("scale_bf16", scale.to(_CPU_COMPUTE_DTYPE))
        return layer

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def weight_bytes(self) -> int:
        """Bytes a product reads for the weight (its integers and scales): the floor's numerator."""
        names = ("packed", "scale_and_zero") if self.format == "int4" and hasattr(self, "packed") else \
            ("qweight", "scale", "zero")
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names if hasattr(self, n))

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [out_features, in_features] in `dtype` (default: the model's)."""
        dtype = dtype or self.dtype
        if self.format == "int8":
            return quantize.dequantize_int8(self.qweight, self.scale, dtype)
        if self.format == "int4":
            return quantize.dequantize_int4(quantize.unpack_nibbles(self.qweight), self.scale, self.zero, dtype)
        return quantize.dequantize_fp8(self.qweight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features] in x's dtype."""
        rows = x.shape[0] if x.dim() == 2 else -1
        if x.device.type == "cpu" and self.format in ("int8", "int4") and 0 < rows <= DEQUANTIZE_ABOVE_ROWS:
            xc = x.to(_CPU_COMPUTE_DTYPE)
            if self.format == "int8":
                out = torch.ops.aten._weight_int8pack_mm(xc, self.qweight, self.scale_bf16)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, self.packed, quantize.INT4_GROUP,
                                                                   self.scale_and_zero)
            out = out.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        if self.format == "fp8" and x.is_cuda:
            from ..kernels import linear

            return linear(x, self.qweight, self.bias, weight_scale=self.scale)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, owner, attribute) of every nn.Linear of `model`: its projections and the LM head."""
    return [(f"{prefix}.{name}" if prefix else name, module, name) for prefix, module in model.named_modules()
            for name, child in module.named_children() if isinstance(child, nn.Linear)]


# What CausalLM.use_fused_kernels stacks (model/transformer.py _fuse_linears): quantizing restacks them.
FUSED_BUFFERS = tuple(f"{prefix}_{part}" for prefix in ("qkv", "gate_up") for part in ("weight", "weight_scale", "bias"))
INT4_OUTPUT_MULTIPLE = 16  # torch's CPU int4 packing takes out_features in multiples of 16


def int4_fits(linear: nn.Linear) -> bool:
    """Whether int4's products take this weight's shape: whole groups of inputs, and outputs in 16s."""
    return linear.in_features % quantize.INT4_GROUP == 0 and linear.out_features % INT4_OUTPUT_MULTIPLE == 0


@torch.no_grad()
def quantize_model(model: nn.Module, format: str,
                   absmax_of: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Replace every nn.Linear of `model` by a QuantizedLinear of `format`, in place, one at a time (so memory
    holds at most one float weight beside the quantized model). A tied LM head gets its own quantized copy;
    the embedding keeps the float table.

    For int4, a weight that a GGUF file stored quantized above 4 bits (model.stored_above_4_bits, set by
    model/gguf.py: Q8_0, Q6_K, ...) becomes int8 instead: 4 bits would add the error its file chose to avoid
    (SmolLM2's Q8_0 LM head in int4: 9% relative error in its products, in int8 1.2%). So does a weight whose
    shape the int4 kernel cannot take (int4_fits).

    absmax_of(name, absmax): for each int8 or fp8 product in turn (name: its qualified name, absmax: its weight's
    channel_absmax), the magnitudes to scale it by (a tensor-parallel rank's: distributed/shard.quantize_shard)."""
    for module in model.modules():  # stacked float weights of an earlier use_fused_kernels: stacked again
        for name in FUSED_BUFFERS:
            if hasattr(module, name):
                delattr(module, name)
    keep_8_bits = getattr(model, "stored_above_4_bits", set())
    embedding = model.get_submodule("model.embed_tokens").weight
    for qualified, owner, name in linear_layers(model):
        linear = getattr(owner, name)
        stored_as = "model.embed_tokens.weight" if linear.weight is embedding else f"{qualified}.weight"  # tied
        chosen = "int8" if format == "int4" and (stored_as in keep_8_bits or not int4_fits(linear)) else format
        absmax = None
        if absmax_of is not None and chosen in ("int8", "fp8"):
            absmax = absmax_of(qualified, quantize.channel_absmax(linear.weight.detach()))
        setattr(owner, name, QuantizedLinear.from_linear(linear, chosen, absmax))
    model.weights_format = format
