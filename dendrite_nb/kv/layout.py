"""What the KV cache hands to attention: one forward's batch layout, its shared segments, one layer's caches.

The cache side (kv/tree.py, kv/cascade.py, kv/pool.py) builds these; the attention backends read them. They live
here so that dependencies point one way: the backends depend on kv (these types, kv/fp8.py), never kv on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class KVSegment(NamedTuple):
    """A run of context positions [start, end) that several batch rows read at once (tree-aware attention).

    The rows' contexts are identical over [start, end), because the rows descend from one tree node;
    a kernel reads these positions once for all of them and merges the partial results by log-sum-exp.
    Immutable. A tuple, not a frozen dataclass: a decode step makes one per row (each row's growing private
    run), and a tuple is made 4x faster.
    """

    rows: tuple[int, ...]  # batch rows (indices into the layout's sequences) that attend to these positions
    start: int  # first context position
    end: int  # one past the last context position
    blocks: tuple[int, ...]  # physical block of each logical block start // block_size .. (end - 1) // block_size


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """One forward's sequences, host-side. Sequence i contributes q_lens[i] new tokens, laid out in order."""

    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # context per sequence after the new tokens are written
    block_tables: list[list[int]]  # physical block per logical block index, per sequence
    # Each row's context [0, kv_len) cut into segments, shared ones read once for all their rows: in decode
    # steps (every q_len is 1), and in prefills for backends that declare tree_prefill (a row's new tokens
    # then lie in its own segments). None: every row reads its own block table (flat paged attention).
    segments: list[KVSegment] | None = None

    @property
    def positions(self) -> list[int]:
        if self.is_decode:  # each row's one new token sits at its last position: no per-token loop
            return [kv - 1 for kv in self.kv_lens]
        return [p for q, kv in zip(self.q_lens, self.kv_lens) for p in range(kv - q, kv)]

    @property
    def is_decode(self) -> bool:
        return self.q_lens.count(1) == len(self.q_lens)  # one C loop: a decode step of 1,000 rows asks twice


class LayerKV(NamedTuple):
    """One layer's slice of the KV pool. Caches are [num_blocks, block_size, kv_heads, head_dim] in the pool's
    kv dtype. With an fp8 pool each token's K and V head vectors carry their own dequantisation scale."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads] float32, fp8 pools only
    v_scale: torch.Tensor | None = None
