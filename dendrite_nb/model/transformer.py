"""Llama 3 / Qwen3 decoder over a paged KV cache. Tokens are flat ([T] = all sequences' new tokens in order).

Module and parameter names follow HF (`model.layers.0.self_attn.q_proj.weight`, ...) so checkpoint
tensor names map one to one.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig
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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.shape = (heads, kv_heads, head_dim)

    def forward(self, x, cos, sin, kv, backend, plan) -> torch.Tensor:
        heads, kv_heads, head_dim = self.shape
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, heads, head_dim)
        k = self.k_proj(x).view(tokens, kv_heads, head_dim)
        v = self.v_proj(x).view(tokens, kv_heads, head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.append_kv(plan, kv, k, v)
        out = backend.attend(plan, q, kv)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(tokens, heads * head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
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

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(self, device: torch.device) -> None:
        """Compute the non-learned state on `device` (the RoPE frequencies)."""
        self.inv_freq = rope_inv_freq(self.config, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers: list[Any],
                backend: Any, plan: Any) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]; writes each token's KV."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_layers):  # kv: the layer's LayerKV
            x = layer(x, cos, sin, kv, backend, plan)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> float32 logits [B, vocab]."""
        return self.lm_head(hidden).float()
