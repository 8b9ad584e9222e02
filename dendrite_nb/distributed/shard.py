"""Megatron-style sharding of a CausalLM over `world` tensor-parallel ranks, in place.

Each rank keeps a contiguous run of the attention heads and of the KV heads (q/k/v split by output rows, o_proj by
its input columns) and of the MLP's intermediate features (gate/up by output rows, down by input columns). The
partial outputs of o_proj and down_proj are summed over the ranks by one all-reduce each (the hook set here on
Attention and MLP), which leaves every rank with the same full hidden state; the embedding, the norms and the LM
head stay whole on every rank (the LM head runs on rank 0 only: "gathered", not split by vocabulary). A bias of a
row-split product is added on rank 0 alone, so the sum carries it once.

Rank r's query heads [r * H / N, (r + 1) * H / N) read KV heads [r * KV / N, ...): the same grouping as the whole
model's, so grouped-query attention needs no change.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..errors import TensorParallelError
from ..model.config import ModelConfig
from ..model.transformer import CausalLM


def degrees_for(config: ModelConfig) -> list[int]:
    """The tensor-parallel degrees this model can be split by: the common divisors of its head counts and its
    intermediate size."""
    common = math.gcd(config.num_heads, config.num_kv_heads, config.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_degree(tensor_parallel: object, config: ModelConfig | None = None) -> int:
    """tensor_parallel as an int, or TensorParallelError naming what would work (before anything is started)."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise TensorParallelError(f"tensor_parallel must be an int >= 1 (the number of processes, one per GPU, the "
                                  f"model is split over), got {tensor_parallel!r}.")
    if config is not None and tensor_parallel not in degrees_for(config):
        raise TensorParallelError(
            f"tensor_parallel={tensor_parallel} cannot split this model ({config.describe()}, intermediate "
            f"{config.intermediate_size}): its attention heads ({config.num_heads}), KV heads "
            f"({config.num_kv_heads}) and intermediate size must all be divisible by it. This model runs at "
            f"tensor_parallel {', '.join(map(str, degrees_for(config)))}.")
    return tensor_parallel


def local_heads(config: ModelConfig, world: int) -> tuple[int, int]:
    """(attention heads, KV heads) one rank holds."""
    return config.num_heads // world, config.num_kv_heads // world


def weights_checksum(model: nn.Module) -> list[float]:
    """One float64 sum per parameter: equal lists on every rank say they built the same whole model (checked
    before sharding; a rank that read another file or drew other random weights would differ)."""
    with torch.no_grad():
        return [float(param.double().sum()) for _, param in sorted(model.named_parameters())]


def _rows(linear: nn.Linear, part: slice) -> None:
    """Keep output rows `part` of linear's weight (and bias)."""
    linear.weight = nn.Parameter(linear.weight[part].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[part].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _columns(linear: nn.Linear, part: slice, keep_bias: bool) -> None:
    """Keep input columns `part` of linear's weight; its bias only where keep_bias (rank 0)."""
    linear.weight = nn.Parameter(linear.weight[:, part].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.bias = None
    linear.in_features = linear.weight.shape[1]


def shard_model(model: CausalLM, rank: int, world: int, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Cut `model` (whole, float weights) down to rank's shard, in place, and set the all-reduce hooks.
    check_degree(world, model.config) must have passed."""
    if model.weights_format is not None or model.fused_kernels:
        raise TensorParallelError(f"tensor_parallel > 1 shards float weights run by the reference path; this model "
                                  f"has {model.weights_format or 'fused'} weights.")
    config = model.config
    heads, kv_heads = local_heads(config, world)
    head_dim, features = config.head_dim, config.intermediate_size // world
    q_part = slice(rank * heads * head_dim, (rank + 1) * heads * head_dim)
    kv_part = slice(rank * kv_heads * head_dim, (rank + 1) * kv_heads * head_dim)
    mlp_part = slice(rank * features, (rank + 1) * features)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _rows(attention.q_proj, q_part)
        _rows(attention.k_proj, kv_part)
        _rows(attention.v_proj, kv_part)
        _columns(attention.o_proj, q_part, keep_bias=rank == 0)
        attention.shape = (heads, kv_heads, head_dim)
        attention.all_reduce = all_reduce
        _rows(mlp.gate_proj, mlp_part)
        _rows(mlp.up_proj, mlp_part)
        _columns(mlp.down_proj, mlp_part, keep_bias=rank == 0)
        mlp.all_reduce = all_reduce
    if rank != 0 and not config.tie_word_embeddings:   # only rank 0 computes logits
        model.lm_head = None
    model.tensor_parallel = (rank, world)
