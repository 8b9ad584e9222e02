"""Attention backends behind one plan/run interface."""
from __future__ import annotations

from .base import AttentionBackend, BatchLayout
from .torch_backend import TorchAttention

BACKENDS = {"torch": TorchAttention}


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; choose one of {sorted(BACKENDS)}.")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "BatchLayout", "TorchAttention", "make_backend", "BACKENDS"]
