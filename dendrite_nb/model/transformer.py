"""Llama 3 / Qwen3 decoder over a paged KV cache. Tokens are flat ([T] = all sequences' new tokens in order).

Module and parameter names follow HF (`model.layers.0.self_attn.q_proj.weight`, ...) so checkpoint
tensor names map one to one.

Two paths compute the same thing: `forward` methods are plain torch, the reference and the CPU path;
`forward_fused` methods (after CausalLM.use_fused_kernels(True)) run one GEMM for q/k/v and one for gate/up,
and the Triton kernels of dendrite_nb.kernels for the norms, the residual adds, RoPE and SwiGLU, and for the
projections and LM head of one-row decode steps (gemv, which then also runs each norm and the
SwiGLU inside the projection next to it).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig
from .dense import dense
from .quantized_linear import QuantizedLinear
from .rope import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as HF does, so bf16 results match it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _fuse_linears(owner: nn.Module, prefix: str, linears: list[nn.Module]) -> None:
    """Stack the linears' weights (and biases) by rows into buffers `{prefix}_weight`, `{prefix}_bias` of `owner`
    and make each linear's parameters views into them: one GEMM reads them all, and they are stored once.
    fp8 QuantizedLinears stack their fp8 weights, and their per-channel scales into `{prefix}_weight_scale`
    (None for float weights)."""
    quantized = isinstance(linears[0], QuantizedLinear)
    with torch.no_grad():
        weight = torch.cat([linear.qweight if quantized else linear.weight for linear in linears])
        scale = torch.cat([linear.scale for linear in linears]) if quantized else None
        bias = torch.cat([linear.bias for linear in linears]) if linears[0].bias is not None else None
    # Not persistent: checkpoints and state_dict keep the HF names, which stay the parameters' names.
    owner.register_buffer(f"{prefix}_weight", weight, persistent=False)
    owner.register_buffer(f"{prefix}_weight_scale", scale, persistent=False)
    owner.register_buffer(f"{prefix}_bias", bias, persistent=False)
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        if quantized:
            linear.qweight, linear.scale = weight[rows], scale[rows]
        else:
            linear.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += linear.out_features


def product_weight(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, per-channel scale or None) as the fused kernels' products take them."""
    if isinstance(linear, QuantizedLinear):
        return linear.qweight, linear.scale
    return linear.weight, None


class Attention(nn.Module):
    # On a tensor-parallel rank (distributed/shard.py): sums the ranks' partial o_proj outputs in place. None: the
    # whole model runs here.
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.shape = (heads, kv_heads, head_dim)

    def forward(self, x, cos, sin, kv, backend, plan) -> torch.Tensor:
        heads, kv_heads, head_dim = self.shape
        tokens = x.shape[0]
        q = dense(self.q_proj, x).view(tokens, heads, head_dim)
        k = dense(self.k_proj, x).view(tokens, kv_heads, head_dim)
        v = dense(self.v_proj, x).view(tokens, kv_heads, head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.append_kv(plan, kv, k, v)
        out = backend.attend(plan, q, kv)  # [T, heads, head_dim]
        out = dense(self.o_proj, out.reshape(tokens, heads * head_dim))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def fuse_projections(self) -> None:
        """q/k/v in one weight [(heads + 2 * kv_heads) * head_dim, hidden] (the parameters become views)."""
        if not hasattr(self, "qkv_weight"):
            _fuse_linears(self, "qkv", [self.q_proj, self.k_proj, self.v_proj])

    def forward_fused(self, x, residual, norm, cos, sin, kv, backend, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output, x + residual): `norm` (the layer's input RMSNorm) runs on x + residual inside
        the q/k/v projection's kernel where the step is a GEMV, before it otherwise."""
        from ..kernels import linear, norm_linear, rope_qk

        heads, kv_heads, head_dim = self.shape
        tokens = x.shape[0]
        qkv, residual = norm_linear(x, residual, norm.weight, norm.eps, self.qkv_weight, self.qkv_bias,
                                    weight_scale=self.qkv_weight_scale)
        qkv = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
        # Views into qkv, rows strided by the whole qkv width; RoPE rotates q and k where they lie.
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # [T, heads | kv_heads, head_dim]
        qk_norm = (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else None
        eps = self.q_norm.eps if qk_norm is not None else 0.0
        if backend.capabilities.fused_rope_attend:  # the backend fuses them (triton)
            out = backend.attend_with_rope(plan, kv, q, k, v, cos, sin, qk_norm, eps)  # [T, heads, head_dim]
        else:
            rope_qk(q, k, cos, sin, out=(q, k), norm_weights=qk_norm, eps=eps)
            backend.append_kv(plan, kv, k, v)
            out = backend.attend(plan, q, kv)
        o_weight, o_scale = product_weight(self.o_proj)
        out = linear(out.reshape(tokens, heads * head_dim), o_weight, self.o_proj.bias, weight_scale=o_scale)
        if self.all_reduce is not None:   # before the next norm adds it to the residual stream
            self.all_reduce(out)
        return out, residual


class MLP(nn.Module):
    all_reduce: Callable[[torch.Tensor], None] | None = None  # as Attention's, over down_proj's partial outputs

    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dense(self.down_proj, F.silu(dense(self.gate_proj, x)) * dense(self.up_proj, x))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def fuse_projections(self) -> None:
        """gate and up in one weight [2 * intermediate, hidden] (the parameters become views)."""
        if not hasattr(self, "gate_up_weight"):
            _fuse_linears(self, "gate_up", [self.gate_proj, self.up_proj])

    def forward_fused(self, x, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, x + residual), `norm` (the post-attention RMSNorm) applied to x + residual first; the
        norm and the SwiGLU run inside the gate/up projection's kernel where the step is a GEMV."""
        from ..kernels import linear, linear_silu_mul

        hidden, residual = linear_silu_mul(x, self.gate_up_weight, self.gate_up_bias,
                                           norm=(residual, norm.weight, norm.eps),
                                           weight_scale=self.gate_up_weight_scale)  # [T, intermediate]
        down_weight, down_scale = product_weight(self.down_proj)
        out = linear(hidden, down_weight, self.down_proj.bias, weight_scale=down_scale)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out, residual


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv, backend, plan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, backend, plan)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, residual, cos, sin, kv, backend, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives as x + residual (residual None at the first layer, where x is the stream)
        and leaves the same way, as (MLP output, stream before it): each add happens inside the next norm."""
        x, residual = self.self_attn.forward_fused(x, residual, self.input_layernorm, cos, sin, kv, backend, plan)
        return self.mlp.forward_fused(x, residual, self.post_attention_layernorm)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # Every builder makes the model on the meta device and fills it (model/loader.py, model/gguf.py,
        # distributed/stream_shard.py), so the table skips nn.Embedding's random init: normal_ on a meta tensor
        # imports torch._dynamo, 2-3 s of every load in a fresh process (a notebook kernel, a tensor-parallel worker).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.inv_freq: torch.Tensor | None = None  # set by materialize(), after the weights have a device
        self.fused_kernels = False  # set by use_fused_kernels()
        self.weights_format: str | None = None  # set by quantize_model(): "int8", "int4", "fp8"; None = dtype
        self.tensor_parallel = (0, 1)  # (rank, world): this rank's shard of a model split by distributed/shard.py
        self.whole_fingerprint: str | None = None  # a shard's: its whole model's persist.model_fingerprint

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(self, device: torch.device) -> None:
        """Compute the non-learned state on `device` (the RoPE frequencies)."""
        self.inv_freq = rope_inv_freq(self.config, device)

    def use_fused_kernels(self, enabled: bool) -> None:
        """Run forward through the fused Triton kernels (True) or the plain torch reference (False).

        The first enabling concatenates each layer's q/k/v and gate/up weights and makes the original
        parameters views into them, so weight memory does not grow: call it once the weights are loaded and
        on their device. Raises ImportError without triton, ValueError on a device the kernels cannot use.
        """
        if enabled:
            from ..kernels import unavailable_reason

            reason = unavailable_reason(self.model.embed_tokens.weight.device)
            if reason is not None:
                raise ValueError(f"fused kernels cannot run here: {reason}.")
            if self.weights_format not in (None, "fp8"):
                raise ValueError(f"the fused kernels read float or fp8 weights; these are {self.weights_format}.")
            for layer in self.model.layers:
                layer.self_attn.fuse_projections()
                layer.mlp.fuse_projections()
        self.fused_kernels = enabled

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers: list[Any],
                backend: Any, plan: Any) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]; writes each token's KV."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # [T, head_dim], shared by every layer
        if self.fused_kernels:
            return self._forward_fused(x, cos, sin, kv_layers, backend, plan)
        for layer, kv in zip(self.model.layers, kv_layers):  # kv: the layer's LayerKV
            x = layer(x, cos, sin, kv, backend, plan)
        return self.model.norm(x)

    def _forward_fused(self, x, cos, sin, kv_layers, backend, plan) -> torch.Tensor:
        from ..kernels import add_rms_norm

        residual = None
        for layer, kv in zip(self.model.layers, kv_layers):
            x, residual = layer.forward_fused(x, residual, cos, sin, kv, backend, plan)
        return add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> float32 logits [B, vocab]."""
        if self.fused_kernels:
            from ..kernels import linear

            weight, scale = product_weight(self.lm_head)
            return linear(hidden, weight, weight_scale=scale).float()
        return dense(self.lm_head, hidden).float()
