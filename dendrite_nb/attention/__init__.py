"""Attention backends behind one plan/run interface.

`torch` is the reference (any device); `torch-tree` is the reference with tree-aware decode steps (each shared
tree node read once for all its rows), the fast path off CUDA; `triton` (paged + tree-aware decode) and `flashinfer` need CUDA and
their packages, so they are imported only when asked for. `auto` picks the fastest one that can run here.
"""
from __future__ import annotations

import importlib

import torch

from .base import AttentionBackend, BatchLayout, Capabilities, CapturableBackend, KVSegment, LayerKV
from .torch_backend import TorchAttention

# name -> (module, class); imported lazily so a machine without triton or flashinfer still loads the engine.
BACKENDS = {
    "torch": ("dendrite_nb.attention.torch_backend", "TorchAttention"),
    "torch-tree": ("dendrite_nb.attention.torch_tree_backend", "TorchTreeAttention"),
    "triton": ("dendrite_nb.attention.triton_backend", "TritonAttention"),
    "flashinfer": ("dendrite_nb.attention.flashinfer_backend", "FlashInferAttention"),
}
# Fastest first: the tree-aware Triton kernel reads shared prefixes once; FlashInfer's flat decode does not.
AUTO_ORDER = ("triton", "flashinfer", "torch-tree", "torch")
CUDA_ONLY = ("triton", "flashinfer")


def _backend_class(name: str) -> type:
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       kv_dtype: torch.dtype | None = None) -> str | None:
    """Why backend `name` cannot run this model here, or None when it can. Imports the backend; changes nothing."""
    try:
        cls = _backend_class(name)
    except Exception as error:  # a missing or broken install (e.g. flashinfer without its tvm_ffi)
        return f"it cannot be imported ({type(error).__name__}: {error})"
    return cls.unavailable_reason(device, dtype, head_dim, kv_dtype or dtype)


def make_backend(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 head_dim: int = 128, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    device = torch.device(device)
    if name == "auto":
        for candidate in AUTO_ORDER:
            if candidate in CUDA_ONLY and device.type != "cuda":
                continue  # off CUDA plain torch is the fast path (Triton's CPU interpreter is for tests)
            if unavailable_reason(candidate, device, dtype, head_dim, kv_dtype) is None:
                return _backend_class(candidate)()
        raise RuntimeError("no attention backend can run here")  # torch always can; kept for a clear failure
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; choose one of {sorted(BACKENDS) + ['auto']}.")
    reason = unavailable_reason(name, device, dtype, head_dim, kv_dtype)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run on {device.type} with "
                         f"{str(dtype).removeprefix('torch.')} (KV {str(kv_dtype or dtype).removeprefix('torch.')}) and "
                         f"head_dim {head_dim}: {reason}. "
                         f"Use attention='auto' to pick one that can, or 'torch' (the reference).")
    return _backend_class(name)()


__all__ = ["AttentionBackend", "BatchLayout", "Capabilities", "CapturableBackend", "KVSegment", "LayerKV",
           "TorchAttention", "make_backend", "unavailable_reason", "BACKENDS"]
