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

import functools
import math
from typing import Callable

import torch
from torch import nn

from ..errors import TensorParallelError
from ..model.config import ModelConfig
from ..model.quantized_linear import quantize_model
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


# Which products split by output rows and which by input columns, and the size each rank's part is counted in.
_ROW_SPLIT = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "gate_proj": "features",
              "up_proj": "features"}
_COLUMN_SPLIT = {"o_proj": "heads", "down_proj": "features"}
DROP = "drop"   # parameter_part: this rank holds none of it


def parameter_part(name: str, config: ModelConfig, rank: int, world: int) -> tuple[int, slice] | str | None:
    """What rank keeps of the whole model's parameter `name`: (dim, slice) of it, None for all of it, or DROP.
    A row-split product's bias splits with its rows; a column-split one's stays whole on rank 0 alone (the
    all-reduce adds it once); only rank 0 keeps an untied LM head."""
    module, kind = name.split(".")[-2:]
    if name == "lm_head.weight":
        return DROP if rank != 0 and not config.tie_word_embeddings else None
    heads, kv_heads = local_heads(config, world)
    width = {"heads": heads * config.head_dim, "kv_heads": kv_heads * config.head_dim,
             "features": config.intermediate_size // world}
    if module in _ROW_SPLIT:
        span = width[_ROW_SPLIT[module]]
        return 0, slice(rank * span, (rank + 1) * span)
    if module in _COLUMN_SPLIT:
        if kind == "bias":
            return None if rank == 0 else DROP
        span = width[_COLUMN_SPLIT[module]]
        return 1, slice(rank * span, (rank + 1) * span)
    return None


def place(model: CausalLM, name: str, whole: torch.Tensor, part: tuple[int, slice] | str | None) -> None:
    """Set parameter `name` of `model` to rank's part of `whole` (a copy, so the whole tensor can be freed)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if part == DROP:
        if name == "lm_head.weight":
            model.lm_head = None
        else:
            setattr(owner, leaf, None)   # a bias: nn.Linear reads None as none
        return
    kept = whole if part is None else whole.narrow(part[0], part[1].start, part[1].stop - part[1].start).clone()
    setattr(owner, leaf, nn.Parameter(kept, requires_grad=False))
    if isinstance(owner, nn.Linear) and leaf == "weight":
        owner.out_features, owner.in_features = kept.shape


def shard_weights(model: CausalLM, rank: int, world: int) -> None:
    """Cut a whole model's float weights down to rank's part, in place."""
    if model.weights_format is not None or model.fused_kernels:
        raise TensorParallelError(f"tensor_parallel > 1 shards a model's float weights before its q/k/v and gate/up "
                                  f"are fused (each rank fuses its own part); this model has "
                                  f"{model.weights_format or 'fused'} weights.")
    for name, param in list(model.named_parameters()):
        part = parameter_part(name, model.config, rank, world)
        if part is not None:   # a whole one stays as it is (replaced, a tied embedding would come untied)
            place(model, name, param.data, part)


def connect(model: CausalLM, rank: int, world: int, all_reduce: Callable[..., None]) -> None:
    """Make a model whose weights are rank's part run as that rank: its head counts, the all-reduce hooks.
    all_reduce(tensor, buffer) sums tensor over the ranks in place; buffer is 0 for the attention's and 1 for the
    MLP's, so that two all-reduces in a row never have the same one (peer memory's inboxes take turns)."""
    heads, kv_heads = local_heads(model.config, world)
    for layer in model.model.layers:
        layer.self_attn.shape = (heads, kv_heads, model.config.head_dim)
        layer.self_attn.all_reduce = functools.partial(all_reduce, buffer=0)
        layer.mlp.all_reduce = functools.partial(all_reduce, buffer=1)
    model.tensor_parallel = (rank, world)


def quantize_shard(model: CausalLM, weights: str, max_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Quantize rank's shard as the whole model's quantization would be cut (model/quantized_linear.py): a
    product split by input columns (o_proj, down_proj) scales each output channel by the whole weight's largest
    magnitude, the maximum over the ranks' parts (max_over_ranks: a collective, so every rank calls this at the
    same point, with products in the same order); one split by output rows holds whole channels already. int4's
    groups of 32 inputs fall inside a rank's columns (check_int4_split)."""
    def absmax_of(name: str, absmax: torch.Tensor) -> torch.Tensor:
        return max_over_ranks(absmax) if name.rsplit(".", 1)[-1] in _COLUMN_SPLIT else absmax
    quantize_model(model, weights, absmax_of)


def check_int4_split(config: ModelConfig, world: int) -> None:
    """TensorParallelError unless each rank's part of every product takes int4 exactly when the whole product
    does (int4_fits: whole groups of 32 inputs, outputs in 16s), so the shards quantize as the whole model."""
    from ..model.quantized_linear import INT4_OUTPUT_MULTIPLE
    from ..model.quantize import INT4_GROUP

    hidden, attention = config.hidden_size, config.num_heads * config.head_dim
    kv, features = config.num_kv_heads * config.head_dim, config.intermediate_size
    products = {"q_proj": (attention, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                "o_proj": (hidden, attention), "gate_proj": (features, hidden), "up_proj": (features, hidden),
                "down_proj": (hidden, features)}

    def fits(out_features: int, in_features: int) -> bool:
        return in_features % INT4_GROUP == 0 and out_features % INT4_OUTPUT_MULTIPLE == 0
    for name, (out_features, in_features) in products.items():
        part = ((out_features // world, in_features) if name in _ROW_SPLIT else (out_features, in_features // world))
        if fits(out_features, in_features) != fits(*part):
            raise TensorParallelError(
                f"weights='int4' at tensor_parallel={world}: each rank's part of {name} is {part[0]} x {part[1]}, "
                f"which int4 cannot take (groups of {INT4_GROUP} inputs, outputs in {INT4_OUTPUT_MULTIPLE}s) though "
                f"the whole {out_features} x {in_features} can; use weights='int8', or another degree.")


def shard_model(model: CausalLM, rank: int, world: int, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Cut `model` (whole, float weights) down to rank's shard, in place, and set the all-reduce hooks.
    check_degree(world, model.config) must have passed."""
    shard_weights(model, rank, world)
    connect(model, rank, world, all_reduce)
