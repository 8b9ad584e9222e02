"""Host side of the Triton attention plan: work items and index arrays, built with numpy, packed into one
int32 buffer (one host-to-device copy per forward). No torch device work here.

A work item (ITEM_COLS ints): entry offset, rows, kv_start, kv_end, block offset, first slot, linear slot.
Item i reads positions [kv_start, kv_end) for entries entry_rows[offset: offset + rows]; row j writes partial
slot first + j; the block of position p is block_ids[block offset + p // block_size]; where the run's blocks are
consecutive in the pool (and the plan marks them: `linear_width`), position p is at cache slot linear slot + p -
kv_start, else linear slot is -1.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .triton_kernels import ITEM_COLS
from .triton_tuning import LOOP_PLAN_RUNS, SHORT_RUN_TOKENS


@dataclass(frozen=True, slots=True)
class PlanShape:
    """Section sizes of a packed plan. Equal shapes can share one captured CUDA graph."""

    items: tuple[tuple[int, int], ...]  # (BLOCK_M, number of items) per tile width
    entries: int
    blocks: int
    slots: int
    tokens: int
    short_runs: bool = False  # every item of the narrowest tile spans <= SHORT_RUN_TOKENS positions
    # A decode step whose every item is one row's run of at most one KV tile of this many positions: the fused
    # decode kernel (triton_decode_kernel.py) may take it whole, with this BLOCK_N. 0: not such a step.
    one_tile: int = 0
    # The plan marks runs of consecutive blocks (their items' linear slots) for the TMA launch: decode steps on
    # a backend that uses TMA (triton_tuning.py's TMA lines say why not prefills).
    linear: bool = False

    def sections(self) -> list[tuple[str, int]]:
        return ([(f"items{block_m}", count * ITEM_COLS) for block_m, count in self.items]
                + [("rows", self.entries), ("pos", self.entries), ("blocks", self.blocks),
                   ("indptr", self.tokens + 1), ("slots", self.slots), ("mapping", self.tokens)])

    @property
    def numel(self) -> int:
        return sum(length for _, length in self.sections())

    def fits(self, other: PlanShape) -> bool:
        """Whether a plan of shape `other` can be padded to this one."""
        mine = dict(self.items)
        return (all(count <= mine.get(block_m, 0) for block_m, count in other.items if count)
                and other.entries <= self.entries and other.blocks <= self.blocks
                and other.slots <= self.slots and other.tokens <= self.tokens
                and other.short_runs == self.short_runs  # a captured launch keeps its KV step
                and other.one_tile == self.one_tile  # and its kernel and tile
                and other.linear == self.linear)  # and its loads

    def padded(self, min_tokens: int) -> PlanShape:
        """The next power-of-two shape (so a graph serves many steps of a growing context)."""
        def up(n: int, floor: int = 16) -> int:
            return max(floor, 1 << max(0, n - 1).bit_length())
        # A tile width with no items stays empty: its launch is skipped instead of running padding.
        return PlanShape(tuple((block_m, up(count, 8) if count else 0) for block_m, count in self.items),
                         up(self.entries),
                         up(self.blocks, 64), up(self.slots), max(min_tokens, self.tokens), self.short_runs,
                         self.one_tile, self.linear)


@dataclass(slots=True)
class HostPlan:
    items: dict[int, np.ndarray]  # BLOCK_M -> [W, ITEM_COLS] int32
    entry_rows: np.ndarray  # [E] query token of each entry
    entry_pos: np.ndarray  # [E] its position (causal mask)
    block_ids: np.ndarray  # [NB]
    indptr: np.ndarray  # [T + 1] CSR over tokens into slots
    slots: np.ndarray  # [S]
    slot_mapping: np.ndarray  # [T] flat cache slot of each new token
    num_slots: int
    one_tile: int = 0  # see PlanShape.one_tile
    linear: bool = False  # see PlanShape.linear

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    def shape(self) -> PlanShape:
        narrowest = next(iter(self.items.values()))  # build_host_plan keys items by width, ascending
        short_runs = len(narrowest) > 0 and int((narrowest[:, 3] - narrowest[:, 2]).max()) <= SHORT_RUN_TOKENS
        return PlanShape(tuple((block_m, len(items)) for block_m, items in self.items.items()),
                         len(self.entry_rows), len(self.block_ids), self.num_slots, self.num_tokens, short_runs,
                         self.one_tile, self.linear)

    def pack(self, shape: PlanShape, trash_slot: int) -> torch.Tensor:
        """One int32 tensor holding every section, padded to `shape`: padding items have no rows, padding
        tokens own no slots and write their KV to `trash_slot`."""
        flat = np.zeros(shape.numel, dtype=np.int32)
        offset = 0
        for block_m, count in shape.items:
            items = self.items.get(block_m)
            if items is not None and len(items):
                flat[offset: offset + items.size] = items.ravel()
            offset += count * ITEM_COLS
        for values, size in ((self.entry_rows, shape.entries), (self.entry_pos, shape.entries),
                             (self.block_ids, shape.blocks)):
            flat[offset: offset + len(values)] = values
            offset += size
        flat[offset: offset + len(self.indptr)] = self.indptr
        flat[offset + len(self.indptr): offset + shape.tokens + 1] = self.indptr[-1]
        offset += shape.tokens + 1
        flat[offset: offset + len(self.slots)] = self.slots
        offset += shape.slots
        flat[offset: offset + self.num_tokens] = self.slot_mapping
        flat[offset + self.num_tokens: offset + shape.tokens] = trash_slot
        return torch.from_numpy(flat)


@dataclass(frozen=True, slots=True)
class KVRuns:
    """A forward's KV runs as flat arrays (CSR), so a plan of 1,000 rows is built by numpy, not a Python loop
    per run. Run r is read by query tokens rows[row_ptr[r]: row_ptr[r + 1]] over positions [starts[r], ends[r]),
    and blocks[block_ptr[r]: block_ptr[r + 1]] hold its logical blocks from starts[r] // block_size on."""

    row_ptr: np.ndarray  # [R + 1]
    rows: np.ndarray  # [E] query tokens, run after run
    starts: np.ndarray  # [R]
    ends: np.ndarray  # [R]
    block_ptr: np.ndarray  # [R + 1]
    blocks: np.ndarray  # [NB]

    @classmethod
    def of(cls, runs: Sequence[tuple[Sequence[int], int, int, Sequence[int]]]) -> KVRuns:
        """From (query tokens, kv start, kv end, blocks from start // block_size) per run."""
        def csr(lists) -> tuple[np.ndarray, np.ndarray]:
            ptr = np.zeros(len(lists) + 1, dtype=np.int64)
            np.cumsum([len(values) for values in lists], out=ptr[1:])
            return ptr, np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(ptr[-1]))
        row_ptr, rows = csr([run[0] for run in runs])
        block_ptr, blocks = csr([run[3] for run in runs])
        return cls(row_ptr, rows, np.array([run[1] for run in runs], dtype=np.int64),
                   np.array([run[2] for run in runs], dtype=np.int64), block_ptr, blocks)


def build_host_plan(runs: Sequence[tuple[Sequence[int], int, int, Sequence[int]]], positions: Sequence[int],
                    slot_mapping: Sequence[int], block_size: int, group: int, widths: tuple[int, ...],
                    chunk_for: Callable[[int], int], linear_width: int = 0) -> HostPlan:
    """runs: (query tokens, kv start, kv end, blocks from start // block_size) per KV run. positions: [T] each
    query token's position (its causal limit). widths: tile widths (query vectors), ascending. A run takes the
    narrowest tile that holds all its rows x group heads, or tiles of the widest. Each tile width is one
    launch, and launches run one after another, so each width gets its own chunk size: its runs are cut into
    chunks of chunk_for(work) positions, work being that width's tile-positions (sum over its runs of tiles x
    run length). Long runs split until the launch fills the GPU, and short ones stay whole.

    linear_width (one of widths; 0: none): runs whose blocks are consecutive in the pool get their items'
    linear slots, and take tiles of at most this width (the TMA launch's best: docs/lab/gpu-sessions-23-26.md); other
    items' linear slots are -1.

    Items come out run by run, tile by tile (rows in run order), chunk by chunk, and each item's rows take the
    next partial slots in that order. A few runs are planned one by one, many with arrays (the same plan)."""
    if linear_width and linear_width not in widths:
        raise ValueError(f"linear_width {linear_width} is not one of the tile widths {widths}")
    if len(runs) <= LOOP_PLAN_RUNS:
        return plan_by_loop(runs, positions, slot_mapping, block_size, group, widths, chunk_for, linear_width)
    return plan_by_arrays(KVRuns.of(runs), np.asarray(positions, dtype=np.int64), slot_mapping, block_size, group,
                          widths, chunk_for, linear_width)


def linear_base(blocks: Sequence[int], start: int, end: int, block_size: int) -> int | None:
    """The cache slot of position 0 if the blocks of positions [start, end) are consecutive (blocks: the physical
    block of each logical block from start // block_size on), so position p sits at that slot + p; else None."""
    first, needed = start // block_size, -(-end // block_size) - start // block_size
    if needed <= 0:
        return None
    head = blocks[0]
    if needed > 1 and (blocks[needed - 1] - head != needed - 1
                       or np.any(np.diff(np.asarray(blocks[:needed])) != 1)):
        return None
    return (head - first) * block_size


def plan_by_loop(runs: Sequence[tuple[Sequence[int], int, int, Sequence[int]]], positions: Sequence[int],
                 slot_mapping: Sequence[int], block_size: int, group: int, widths: tuple[int, ...],
                 chunk_for: Callable[[int], int], linear_width: int = 0) -> HostPlan:
    """build_host_plan, one run at a time."""
    tiled = []
    work = dict.fromkeys(widths, 0)
    for tokens, start, end, blocks in runs:
        block_m = next((width for width in widths if len(tokens) * group <= width), widths[-1])
        base = linear_base(blocks, start, end, block_size) if linear_width else None
        if base is not None:
            block_m = min(block_m, linear_width)
        tiled.append((block_m, block_m // group, tokens, start, end, blocks, base))
        work[block_m] += -(-len(tokens) // (block_m // group)) * (end - start)
    chunks = {width: chunk_for(width_work) for width, width_work in work.items() if width_work}
    items: dict[int, list[tuple[int, ...]]] = {width: [] for width in widths}
    entry_rows: list[int] = []
    entry_pos: list[int] = []
    block_ids: list[int] = []
    num_slots = 0
    for block_m, per_tile, tokens, start, end, blocks, base in tiled:
        block_off = len(block_ids) - start // block_size
        block_ids.extend(blocks)
        for first in range(0, len(tokens), per_tile):
            tile = list(tokens[first: first + per_tile])
            tile_pos = [positions[token] for token in tile]
            hi = min(end, max(tile_pos) + 1)  # causal: a prefill tile reads nothing past its last token
            entry_off = len(entry_rows)
            entry_rows.extend(tile)
            entry_pos.extend(tile_pos)
            chunk = chunks.get(block_m, 1)  # absent only when every run of this width is empty: nothing to cut
            for lo in range(start, hi, chunk):
                items[block_m].append((entry_off, len(tile), lo, min(hi, lo + chunk), block_off, num_slots,
                                       -1 if base is None else base + lo))
                num_slots += len(tile)
    arrays = {block_m: np.array(rows, dtype=np.int32).reshape(-1, ITEM_COLS) for block_m, rows in items.items()}
    rows_np = np.array(entry_rows, dtype=np.int32)
    indptr, slots = _slots_by_token(np.concatenate(list(arrays.values())), rows_np, len(slot_mapping))
    return HostPlan(arrays, rows_np, np.array(entry_pos, dtype=np.int32), np.array(block_ids, dtype=np.int32),
                    indptr, slots, np.array(slot_mapping, dtype=np.int32), num_slots)


def plan_by_arrays(runs: KVRuns, positions: np.ndarray, slot_mapping: Sequence[int], block_size: int, group: int,
                   widths: tuple[int, ...], chunk_for: Callable[[int], int], linear_width: int = 0) -> HostPlan:
    """build_host_plan, every step an array operation over all runs at once."""
    rows_per_run = np.diff(runs.row_ptr)
    width_list = np.array(widths, dtype=np.int64)
    width_of_run = np.minimum(np.searchsorted(width_list, rows_per_run * group), len(widths) - 1)
    consecutive, base_of_run = (_linear_bases(runs, block_size) if linear_width else
                                (np.zeros(len(rows_per_run), dtype=bool), np.zeros(len(rows_per_run), np.int64)))
    if linear_width:  # consecutive runs take tiles of at most linear_width
        width_of_run = np.where(consecutive, np.minimum(width_of_run, widths.index(linear_width)), width_of_run)
    per_tile = width_list[width_of_run] // group  # rows per tile
    tiles = -(-rows_per_run // per_tile)
    work = np.bincount(width_of_run, weights=tiles * (runs.ends - runs.starts), minlength=len(widths))
    chunk_of_width = np.array([chunk_for(int(w)) if w else 1 for w in work], dtype=np.int64)

    run_of_tile = np.repeat(np.arange(len(tiles)), tiles)
    tile_in_run = np.arange(len(run_of_tile)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    entry_off = runs.row_ptr[:-1][run_of_tile] + tile_in_run * per_tile[run_of_tile]  # entries are runs.rows
    tile_rows = np.minimum(per_tile[run_of_tile], rows_per_run[run_of_tile] - tile_in_run * per_tile[run_of_tile])
    entry_pos = positions[runs.rows]
    last_pos = np.maximum.reduceat(entry_pos, entry_off) if len(entry_off) else entry_off
    tile_start = runs.starts[run_of_tile]
    tile_hi = np.minimum(runs.ends[run_of_tile], last_pos + 1)  # causal: nothing past the tile's last token
    tile_chunk = chunk_of_width[width_of_run[run_of_tile]]
    chunks = np.where(tile_hi > tile_start, -(-(tile_hi - tile_start) // tile_chunk), 0)

    tile_of_item = np.repeat(np.arange(len(chunks)), chunks)
    chunk_in_tile = np.arange(len(tile_of_item)) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    lo = tile_start[tile_of_item] + chunk_in_tile * tile_chunk[tile_of_item]
    item_rows = tile_rows[tile_of_item]
    run_of_item = run_of_tile[tile_of_item]
    hi = np.minimum(tile_hi[tile_of_item], lo + tile_chunk[tile_of_item])
    table = np.stack([entry_off[tile_of_item], item_rows, lo, hi,
                      runs.block_ptr[:-1][run_of_item] - runs.starts[run_of_item] // block_size,
                      np.cumsum(item_rows) - item_rows,
                      np.where(consecutive[run_of_item], base_of_run[run_of_item] + lo, -1)],
                     axis=1).astype(np.int32).reshape(-1, ITEM_COLS)
    width_of_item = width_of_run[run_of_item]
    arrays = {width: table[width_of_item == index] for index, width in enumerate(widths)}
    rows_np = runs.rows.astype(np.int32)
    indptr, slots = _slots_by_token(np.concatenate(list(arrays.values())), rows_np, len(slot_mapping))
    return HostPlan(arrays, rows_np, entry_pos.astype(np.int32), runs.blocks.astype(np.int32), indptr, slots,
                    np.asarray(slot_mapping, dtype=np.int32), int(item_rows.sum()))


def _linear_bases(runs: KVRuns, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """linear_base of every run at once: ([R] bool, whether the run's blocks are consecutive; [R] the slot of
    position 0 where they are, which may be negative: only positions from the run's start are read)."""
    first = runs.starts // block_size
    needed = -(-runs.ends // block_size) - first
    if not len(runs.blocks):
        return np.zeros(len(first), dtype=bool), np.zeros(len(first), dtype=np.int64)
    steps_ok = np.diff(runs.blocks) == 1  # [NB - 1]: block k + 1 follows block k
    breaks = np.concatenate([[0], np.cumsum(~steps_ok)])  # [NB]: non-consecutive steps before block k
    head_at = np.minimum(runs.block_ptr[:-1], len(runs.blocks) - 1)
    last_at = np.clip(runs.block_ptr[:-1] + needed - 1, head_at, len(runs.blocks) - 1)
    consecutive = (needed > 0) & (breaks[last_at] == breaks[head_at])
    return consecutive, (runs.blocks[head_at] - first) * block_size


def _slots_by_token(items: np.ndarray, entry_rows: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of each token's partial slots (in item order), from the items' (entry offset, rows, first slot)."""
    counts = items[:, 1].astype(np.int64)
    item_of = np.repeat(np.arange(len(items)), counts)  # one entry per (item, row)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens = entry_rows[items[item_of, 0] + within]
    slots = items[item_of, 5] + within
    order = np.argsort(tokens, kind="stable")
    indptr = np.zeros(num_tokens + 1, dtype=np.int32)
    np.cumsum(np.bincount(tokens, minlength=num_tokens), out=indptr[1:])
    return indptr, slots[order].astype(np.int32)
