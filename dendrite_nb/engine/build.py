"""What an engine is built from: the weights and tokenizer of a checkpoint (HF folder or GGUF) or of a random
config, and the sizes that depend on the device (the KV pool, the prefill chunk, whether CUDA graphs run).

Called once per engine, before its first call; nothing here touches a branch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..attention import AttentionBackend, make_backend
from ..config import KV_DTYPES, EngineConfig, parse_dtype
from ..errors import CheckpointError
from ..kv import KVPool
from ..model.config import ModelConfig
from ..model.gguf import find_gguf, load_gguf
from ..model.loader import load_model, random_model, read_config
from ..model.quantized_linear import quantize_model
from ..model.transformer import CausalLM
from ..paths import user_path

CPU_KV_BUDGET_BYTES = 1 << 30
CUDA_KV_FRACTION = 0.85  # of the memory free after the weights; the rest is for activations
# A GPU that shares the host's memory (DGX Spark's GB10, Jetson): the KV pool would take it from the host too
# (the notebook, the OS), so by default it takes half of what is free. NVIDIA's advice for these parts is
# to size buffers against host memory (cudaDeviceProp::integrated).
CUDA_INTEGRATED_KV_FRACTION = 0.5


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype,
                    weights: str | None = None) -> tuple[CausalLM, Any, Path]:
    """(model, tokenizer, the file or folder it came from) for an HF folder or a GGUF (Engine.from_pretrained);
    weights: a format of model/quantized_linear.py, or None."""
    folder = user_path(path)
    gguf_file = find_gguf(folder)
    if gguf_file is not None:
        model, tokenizer = load_gguf(gguf_file, device, dtype)
        return _quantized(model, weights), tokenizer, gguf_file
    config, _ = read_config(folder)
    tokenizer = hf_tokenizer(folder)
    return _quantized(load_model(folder, config, device, dtype), weights), tokenizer, folder


def hf_tokenizer(folder: Path) -> Any:
    """The tokenizer of an HF checkpoint folder, or CheckpointError saying what it lacks."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot load a tokenizer from {str(folder)!r} ({error}); "
                              f"the folder needs tokenizer.json and tokenizer_config.json.") from error


def random_weights(hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype, weight_seed: int,
                   weights: str | None = None) -> CausalLM:
    """A model with random weights for an HF config dict (Engine.from_random)."""
    return _quantized(random_model(ModelConfig.from_hf(hf_config), device, dtype, weight_seed), weights)


def _quantized(model: CausalLM, weights: str | None) -> CausalLM:
    if weights is not None:
        quantize_model(model, weights)
    return model


def default_num_blocks(config: ModelConfig, kv_dtype: torch.dtype, device: torch.device, block_size: int) -> int:
    """KV blocks that fit the device: a share of a GPU's free memory, or room for eight full contexts on the CPU."""
    bytes_per_block = KVPool.block_bytes(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                                         head_dim=config.head_dim, block_size=block_size, dtype=kv_dtype)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        integrated = getattr(torch.cuda.get_device_properties(device), "is_integrated", False)
        budget = int(free_bytes * (CUDA_INTEGRATED_KV_FRACTION if integrated else CUDA_KV_FRACTION))
    else:  # room for eight full contexts, within a budget a laptop can spare
        budget = min(CPU_KV_BUDGET_BYTES, 8 * config.max_position_embeddings * bytes_per_block // block_size)
    return max(1, budget // bytes_per_block)


def fused_kernels_available(device: torch.device) -> bool:
    """Whether the Triton decoder kernels can run on `device` (imported only here: triton is optional)."""
    try:
        from ..kernels import unavailable_reason
    except ImportError:
        return False
    return unavailable_reason(device) is None


def graphs_unavailable_reason(device: torch.device, backend: AttentionBackend) -> str | None:
    """Why CUDA graphs cannot replay this engine's steps, or None when they can."""
    if device.type != "cuda":
        return "they need a CUDA device"
    if not backend.capabilities.capturable_plans:
        return f"the {backend.name!r} backend's plans cannot be captured; use attention='triton'"
    return None


ANY_HEAD_DIM = 128   # a head size every attention backend takes (check_backend_request without the model's)


def check_backend_request(config: ModelConfig | None, dtype: torch.dtype, settings: EngineConfig) -> None:
    """Raise what the engine's attention backend and CUDA graphs would raise for this model and these options (an
    unknown backend, one that cannot run here, cuda_graphs=True where graphs cannot), before a weight loads.
    config None (a checkpoint whose config is not read yet: a GGUF's takes a second): what does not depend on the
    model's head size."""
    head_dim = config.head_dim if config is not None else ANY_HEAD_DIM
    kv_dtype = dtype if settings.kv_dtype is None else parse_dtype(settings.kv_dtype, KV_DTYPES, "kv_dtype")
    backend = make_backend(settings.attention, settings.device, dtype, head_dim, kv_dtype)
    reason = graphs_unavailable_reason(settings.device, backend)
    if settings.cuda_graphs and reason is not None:
        raise ValueError(f"cuda_graphs=True, but {reason}.")


def forward_graphs(wanted: bool | None, model: CausalLM, backend: AttentionBackend, pool: KVPool,
                   kv_layers: list[Any], device: torch.device, tensor_group: Any = None):
    """The CUDA graphs that decode steps and short prefills replay (CUDA, with a backend whose plans can be
    padded: triton), or None. wanted=None: wherever they can run; True where they cannot raises ValueError.
    tensor_group: a tensor-parallel engine's workers, which capture and replay each graph with rank 0."""
    reason = graphs_unavailable_reason(device, backend)
    if wanted is None:
        wanted = reason is None
    if not wanted:
        return None
    if reason is not None:
        raise ValueError(f"cuda_graphs=True, but {reason}.")
    from ..cuda_graphs import ForwardGraphs

    return ForwardGraphs(model, backend, kv_layers, device, pool.block_size, pool.sink_slot, tensor_group,
                         None if tensor_group is None else tensor_group.broadcast,
                         None if tensor_group is None else tensor_group.graph_launched)
