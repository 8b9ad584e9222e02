"""Paged attention in Triton: prefill, flat decode and tree-aware decode through one kernel.

plan() turns the layout into work items on the host (see triton_kernels.py for the item table), packs
every index array into one int32 buffer and sends it to the device in one non-blocking copy from pinned
memory; attend() launches the item kernel (once per tile width) and the merge kernel, with no host sync.
For a decode batch with segments (BatchLayout.segments, built by kv/cascade.py), a shared prefix is one
item per tile of rows: its KV is read once for all of them. A prefill of several sequences under shared nodes
(instructions appended to forks of one document) is cut the same way, a shared node's run holding the new
tokens of every sequence under it: read once per tile of those tokens, where a flat prefill reads it once per
sequence.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field

import torch
import triton
from triton.runtime.errors import OutOfResources

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton before 3.4: no TMA (tma_reason says so)
    TensorDescriptor = None

from ..kernels.kv_append import append_kv as append_kv_kernel
from ..kernels.pdl import pdl_arguments
from ..kernels.rope import UNFUSED_FLOAT_OPS, rope_qk
from ..kv.fp8 import INV_FP8_MAX, MIN_SCALE
from .base import BatchLayout, Capabilities, LayerKV
from .triton_decode_kernel import decode_tile_attention_kernel
from .triton_kernels import ITEM_COLS, LOG2E, merge_partials_kernel, segment_attention_kernel
from .triton_plan import HostPlan, PlanShape, build_host_plan
from .triton_tuning import (BLOCK_N, LOW_PRECISION_PARTIALS, MERGE_BLOCK_H, MERGE_BLOCK_S, MERGE_WARPS,
                            MIN_CHUNK_TOKENS, NARROW_LAUNCH, ONE_TILE_PROGRAMS_PER_SM, ONE_TILE_WARPS,
                            ONE_TILE_WIDTHS, PROGRAMS_PER_SM, SHORT_RUN_LAUNCH, TILE_WIDTHS, TMA_MEASURED_MAJOR,
                            TMA_TILE_WIDTH, WIDE_LAUNCH)

# The measured launch settings are in triton_tuning.py. These follow from the hardware or the tests:
INTERPRET_BLOCK_N = 16  # the CPU interpreter runs each element in numpy; small tiles keep tests fast
INTERPRET_ONE_TILE_WIDTHS = (16, 32)  # the interpreter's (INTERPRET_BLOCK_N and twice it: tests reach both)
# GPUs with 99 KB of shared memory a block (GB10, RTX 40xx/50xx, L40S) cannot run every launch tuned on Hopper's
# 227 KB: one that does not fit steps down (smaller_launch), a fused width gives way to the general path.
MIN_BLOCK_N = 16  # tl.dot's smallest tile side
FP8_CAPABILITY = (8, 9)  # the first GPUs with e4m3 in hardware, which Triton's fp8e4nv needs


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(slots=True)
class _Launch:
    items: torch.Tensor  # [W, ITEM_COLS] int32 on the device
    block_m: int
    short: bool  # every item spans <= SHORT_RUN_TOKENS positions: the short-run launch settings apply


@dataclass(slots=True)
class TritonPlan:
    num_slots: int
    slot_mapping: torch.Tensor  # [T] int32 flat cache slot of each new token
    launches: list[_Launch]
    one_tile: int  # PlanShape.one_tile: attend_with_rope may take the step in one launch per layer (its BLOCK_N)
    linear: bool  # PlanShape.linear: items may carry linear slots, which the wide launches read through TMA
    entry_rows: torch.Tensor  # [E] int32 query token of each (item, row) entry
    entry_pos: torch.Tensor  # [E] int32 its position, for the causal mask
    block_ids: torch.Tensor  # [NB] int32 the blocks the items read
    slot_indptr: torch.Tensor  # [T + 1] int32 CSR: slots of token t are slots[indptr[t]:indptr[t+1]]
    slots: torch.Tensor  # [S] int32
    host: torch.Tensor | None = None  # the pinned staging buffer; kept alive until its copy has run
    scratch: dict = field(default_factory=dict)  # partial outputs, allocated by the first layer, reused

    def reads_through_tma(self, launch: _Launch) -> bool:
        """Whether `launch` loads its KV tiles through TMA: host_plan found TMA usable for this device and cache
        (linear), and the wide launches take it, as measured."""
        return self.linear and launch.block_m > 16 and not launch.short


class TritonAttention:
    name = "triton"
    capabilities = Capabilities(tree_segments=True, tree_prefill=True, needs_head_layout=True,
                                capturable_plans=True, fused_rope_attend=True, tma_loads=True)

    def __init__(self, tile_widths: tuple[int, ...] = TILE_WIDTHS, min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                 wide_launch: tuple[int, int] = WIDE_LAUNCH, narrow_launch: tuple[int, int] = NARROW_LAUNCH,
                 wide_block_n: int = BLOCK_N, short_run_launch: tuple[int, int, int] = SHORT_RUN_LAUNCH,
                 programs_per_sm: int = PROGRAMS_PER_SM,
                 merge_block: tuple[int, int, int] = (MERGE_BLOCK_H, MERGE_BLOCK_S, MERGE_WARPS),
                 one_tile_launch: tuple[int, int] | None = None,
                 one_tile_programs_per_sm: float = ONE_TILE_PROGRAMS_PER_SM,
                 one_tile_widths: tuple[int, ...] = ONE_TILE_WIDTHS,
                 low_precision_partials: bool = LOW_PRECISION_PARTIALS, tma: bool | None = None):
        self.tile_widths, self.min_chunk_tokens = tuple(sorted(tile_widths)), min_chunk_tokens
        self.wide_launch, self.narrow_launch = wide_launch, narrow_launch
        self.wide_block_n, self.short_run_launch = wide_block_n, short_run_launch
        self.programs_per_sm, self.merge_block = programs_per_sm, merge_block
        # one_tile_programs_per_sm=0 keeps every step on the general kernels (benchmarks compare the two).
        # one_tile_launch: one (BLOCK_N, num_warps) for every fused step, as tune_one_tile.py compares them; None:
        # the narrowest of one_tile_widths that fits (see _one_tile_width), with ONE_TILE_WARPS.
        self.one_tile_launch, self.one_tile_programs_per_sm = one_tile_launch, one_tile_programs_per_sm
        self.one_tile_widths = tuple(sorted(one_tile_widths))
        self.low_precision_partials = low_precision_partials
        # tma: None picks it where it was measured to pay (tma_reason); True asks for it on any device Triton's
        # descriptors run on, the CPU interpreter included (the tests); False never.
        self.tma = tma
        self.group, self.num_kv_heads = 1, 1  # set by configure(); tiles and chunking depend on them
        self.kv_dtype: torch.dtype | None = None  # set by configure(): whether a plan marks runs for TMA
        self._descriptors: dict[tuple, tuple] = {}
        # Shared memory this GPU lacked (see MIN_BLOCK_N): the fused widths that did not fit, per device, and the
        # settings each general launch stepped down to, by (device, dtypes, BLOCK_M, settings asked for).
        self._unfit_one_tile: dict[torch.device, set[int]] = {}
        self._fitted_launches: dict[tuple, tuple[int, int, int]] = {}
        self._sms: dict[torch.device, int] = {}
        # Plan for a GPU of this many multiprocessors instead of the device's (benchmarks/host_step.py times
        # a GPU's plans on the CPU, where the interpreter's small chunks would make them far larger).
        self.multiprocessors: int | None = None

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, kv_dtype) -> str | None:
        # Without triton this module does not import: attention.unavailable_reason says so.
        if device.type != "cuda" and not interpreting():
            return "Triton kernels need CUDA (or TRITON_INTERPRET=1, the slow CPU interpreter used by the tests)"
        if head_dim < 16 or head_dim & (head_dim - 1):
            return "head_dim must be a power of two of at least 16"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {dtype} is not supported"
        if kv_dtype not in (dtype, torch.float8_e4m3fn):
            return f"the KV dtype must be the model's or float8_e4m3fn, got {kv_dtype}"
        if kv_dtype == torch.float8_e4m3fn and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_CAPABILITY:  # Triton has no e4m3 conversions below it (A100, RTX 30xx)
                return (f"an fp8 (e4m3) KV cache needs a GPU of compute capability "
                        f"{'.'.join(map(str, FP8_CAPABILITY))} or later (Ada, Hopper, Blackwell) for Triton's e4m3 "
                        f"conversions; this one is {'.'.join(map(str, capability))}")
        return None

    # ---- plan ---------------------------------------------------------------------------------------
    def plan(self, layout: BatchLayout, block_size: int, device: torch.device,
             shape: PlanShape | None = None, trash_slot: int = 0, host: HostPlan | None = None) -> TritonPlan:
        """Device metadata for one forward. With `shape` (CUDA graphs), every section is padded to it:
        padding items have no rows, padding tokens own no slots and write their KV to `trash_slot`.
        host: host_plan(layout, ...) where the caller has made it already."""
        host = host if host is not None else self.host_plan(layout, block_size, device)
        shape = shape or host.shape()
        packed = host.pack(shape, trash_slot)
        if device.type == "cuda":
            packed = packed.pin_memory()
        return self.bind(packed.to(device, non_blocking=True), shape, host=packed)

    def bind(self, buffer: torch.Tensor, shape: PlanShape, host: torch.Tensor | None = None) -> TritonPlan:
        """A plan whose tensors are views of `buffer` (int32, laid out as PlanShape.sections says)."""
        views, offset = {}, 0
        for name, length in shape.sections():
            views[name] = buffer[offset: offset + length]
            offset += length
        narrowest = shape.items[0][0] if shape.items else 0
        launches = [_Launch(views[f"items{block_m}"].view(count, ITEM_COLS), block_m,
                            shape.short_runs and block_m == narrowest)
                    for block_m, count in shape.items if count]
        return TritonPlan(num_slots=shape.slots, slot_mapping=views["mapping"], launches=launches,
                          one_tile=shape.one_tile, linear=shape.linear, entry_rows=views["rows"],
                          entry_pos=views["pos"], block_ids=views["blocks"], slot_indptr=views["indptr"],
                          slots=views["slots"], host=host)

    def host_plan(self, layout: BatchLayout, block_size: int, device: torch.device) -> HostPlan:
        """Work items and index arrays for `layout`, on the host (no device work)."""
        narrow = max(16, 1 << (self.group - 1).bit_length())
        positions = layout.positions
        tables = (layout.block_tables if layout.is_decode  # each token's block table (a decode row has one token)
                  else [table for table, q in zip(layout.block_tables, layout.q_lens) for _ in range(q)])
        slot_mapping = [table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)]
        widths = (narrow,) + tuple(w for w in self.tile_widths if w > narrow)
        runs = self._runs(layout)
        tile = self._one_tile_width(layout, runs, device)
        if tile:
            host = build_host_plan(runs, positions, slot_mapping, block_size, self.group, widths, lambda work: tile)
            host.one_tile = tile
            return host
        linear_width = (TMA_TILE_WIDTH if layout.is_decode and TMA_TILE_WIDTH in widths[1:]
                        and self.kv_dtype is not None and self.uses_tma(device, self.kv_dtype) else 0)
        host = build_host_plan(runs, positions, slot_mapping, block_size, self.group, widths, self._chunker(device),
                               linear_width)
        host.linear = bool(linear_width)
        return host

    def tma_reason(self, device: torch.device, kv_dtype: torch.dtype) -> str | None:
        """Why KV tiles of consecutive blocks do not load through TMA here, or None where they do."""
        if self.tma is False:
            return "turned off (tma=False)"
        if TensorDescriptor is None:
            return "this Triton has no host tensor descriptors (triton.tools.tensor_descriptor)"
        if kv_dtype == torch.float8_e4m3fn:
            return "an fp8 cache's tiles need their scales from the block table"
        if self.tma:
            return None
        if device.type != "cuda" or interpreting():
            return "TMA is a CUDA GPU's (tma=True runs it in the interpreter)"
        if torch.cuda.get_device_capability(device)[0] != TMA_MEASURED_MAJOR:
            return ("measured on Hopper (compute capability 9.x) only; tma=True asks for it on other GPUs of "
                    "compute capability 9.0 or later")
        if kv_dtype not in (torch.bfloat16, torch.float16):
            return f"measured for bf16 and fp16 caches only, not {kv_dtype}"
        return None

    def uses_tma(self, device: torch.device, kv_dtype: torch.dtype) -> bool:
        return self.tma_reason(_device_key(device), kv_dtype) is None

    def one_tile_candidates(self) -> tuple[int, ...]:
        """The fused decode kernel's tile widths (BLOCK_N), narrowest first."""
        if interpreting():
            return (INTERPRET_BLOCK_N,) if self.one_tile_launch is not None else INTERPRET_ONE_TILE_WIDTHS
        return (self.one_tile_launch[0],) if self.one_tile_launch is not None else self.one_tile_widths

    def _one_tile_width(self, layout: BatchLayout, runs: list[tuple], device: torch.device) -> int:
        """The fused decode kernel's BLOCK_N for this step, or 0 where the general kernels take it. It takes
        decode steps whose runs each have one row, cut into tiles of the narrowest width whose programs (tiles x
        KV heads) stay within one_tile_programs_per_sm a multiprocessor. The interpreter takes any number, so
        tests reach the kernel (at the narrowest width unless `multiprocessors` is set)."""
        if (self.one_tile_programs_per_sm <= 0 or not layout.is_decode
                or any(len(run[0]) != 1 for run in runs)):
            return 0
        unfit = self._unfit_one_tile.get(_device_key(device), ())
        widths = [width for width in self.one_tile_candidates() if width not in unfit]
        if not widths:
            return 0
        if self.multiprocessors is None and device.type != "cuda":
            return widths[0]
        most = self.one_tile_programs_per_sm * self._multiprocessors(device)
        if len(runs) * self.num_kv_heads > most:  # each run is a tile at least: no need to count (1,000 rows)
            return 0
        for width in widths:
            if sum(-(-(end - start) // width) for _, start, end, _ in runs) * self.num_kv_heads <= most:
                return width
        return 0

    def unfit_one_tile_widths(self, device: torch.device | str) -> frozenset[int]:
        """The fused decode widths that needed more shared memory than `device` has, so far."""
        return frozenset(self._unfit_one_tile.get(_device_key(torch.device(device)), ()))

    def stepped_down_launches(self) -> list[tuple[int, tuple[int, int, int], tuple[int, int, int]]]:
        """(BLOCK_M, (BLOCK_N, warps, stages) asked for, settings that fit) of each general launch that needed
        more shared memory than its GPU has, so far."""
        return sorted({(key[3], key[4], fitted) for key, fitted in self._fitted_launches.items() if key[4] != fitted})

    def _one_tile_warps(self) -> int:
        return self.one_tile_launch[1] if self.one_tile_launch is not None else ONE_TILE_WARPS

    def _multiprocessors(self, device: torch.device) -> int:
        if self.multiprocessors is not None:
            return self.multiprocessors
        if device not in self._sms:
            self._sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._sms[device]

    @staticmethod
    def _runs(layout: BatchLayout) -> list[tuple]:
        """(query tokens, kv start, kv end, blocks from start // block_size) per KV run: a decode step's segments
        (a KVSegment is that tuple: a decode row is one token), a prefill's segments with each row's new tokens
        in place of the row (a shared node's run then holds every token under it, read once per tile of them),
        or each sequence's whole context (flat)."""
        if layout.segments is not None and (layout.is_decode or any(len(seg.rows) > 1 for seg in layout.segments)):
            if layout.is_decode:
                return layout.segments
            offsets = list(itertools.accumulate(layout.q_lens[:-1], initial=0))
            tokens_of = [range(first, first + q) for first, q in zip(offsets, layout.q_lens)]
            return [([token for row in seg.rows for token in tokens_of[row]], seg.start, seg.end, seg.blocks)
                    for seg in layout.segments]
        runs, first = [], 0
        for q, kv, table in zip(layout.q_lens, layout.kv_lens, layout.block_tables):
            runs.append((range(first, first + q), 0, kv, table))
            first += q
        return runs

    def _chunker(self, device: torch.device):
        """chunk_for(work): positions per item, for a launch of `work` tile-positions (tiles x run lengths).
        Runs are cut so that, with every KV head, the items give each multiprocessor about programs_per_sm
        programs of equal work, but never below min_chunk_tokens: each chunk adds a partial result per row
        to write and merge. So one leaf's long context splits across the GPU, and 64 short private runs
        beside a shared prefix stay whole while the prefix splits."""
        if self.multiprocessors is None and device.type != "cuda":
            return lambda work: max(self.min_chunk_tokens // 2, 1)  # the interpreter: small chunks, several per run
        programs = self.programs_per_sm * self._multiprocessors(device)

        def chunk_for(work: int) -> int:
            chunk = max(self.min_chunk_tokens, math.ceil(work * self.num_kv_heads / programs))
            return -(-chunk // BLOCK_N) * BLOCK_N
        return chunk_for

    # ---- run ----------------------------------------------------------------------------------------
    def append_kv(self, plan: TritonPlan, kv: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        append_kv_kernel(k, v, kv.k, kv.v, plan.slot_mapping, kv.k_scale, kv.v_scale)  # one launch; fp8 quantised

    def rope_and_append(self, plan: TritonPlan, kv: LayerKV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, norm_weights, eps: float) -> None:
        """RoPE on q and k in place (with Qwen3's q/k norms) and the KV append: one launch, or two for an fp8
        cache (its quantising append stays its own kernel)."""
        if kv.k_scale is not None:
            rope_qk(q, k, cos, sin, out=(q, k), norm_weights=norm_weights, eps=eps)
            self.append_kv(plan, kv, k, v)
            return
        rope_qk(q, k, cos, sin, out=(q, k), norm_weights=norm_weights, eps=eps,
                append=(v, kv.k, kv.v, plan.slot_mapping))

    def attend_with_rope(self, plan: TritonPlan, kv: LayerKV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, norm_weights, eps: float) -> torch.Tensor:
        """RoPE (after Qwen3's q/k norms where norm_weights are given) on the step's q and k, the KV append, and
        the attention -> [T, heads, head_dim]. A one-tile decode plan takes two launches (triton_decode_kernel.py,
        quantising to fp8 where the cache is; then the merge); any other, three (rope_and_append, then attend), as
        does a one-tile plan whose width needs more shared memory than the GPU has (later plans skip that width).
        q, k, v [T, heads | kv_heads, head_dim] are the raw projections; the two-launch path leaves them as
        they are, the other rotates q and k in place."""
        if plan.one_tile and plan.one_tile not in self._unfit_one_tile.get(q.device, ()):  # q.device: cuda:N
            try:
                return self._attend_one_tile(plan, kv, q, k, v, cos, sin, norm_weights, eps)
            except OutOfResources:  # raised before launching: nothing ran. Later plans skip this width.
                self._unfit_one_tile.setdefault(_device_key(q.device), set()).add(plan.one_tile)
        self.rope_and_append(plan, kv, q, k, v, cos, sin, norm_weights, eps)
        return self.attend(plan, q, kv)

    def _attend_one_tile(self, plan, kv, q, k, v, cos, sin, norm_weights, eps) -> torch.Tensor:
        self._check_group(q, kv)
        num_heads, head_dim = q.shape[1:]
        kv_heads = kv.k.shape[2]
        if k.stride() != v.stride() or cos.stride() != sin.stride() or k.stride(2) != 1 or q.stride(2) != 1:
            raise ValueError(f"the fused decode attention needs k and v laid out alike with contiguous head "
                             f"vectors (q {q.stride()}, k {k.stride()}, v {v.stride()}), and cos like sin.")
        partial, lse = self._scratch(plan, q)
        (launch,) = plan.launches  # one row per item: every item is of the narrowest width
        q_norm, k_norm = norm_weights if norm_weights is not None else (cos, cos)  # unread without norms
        ks, vs, stride_sb, stride_st = _scale_arguments(kv, partial)
        decode_tile_attention_kernel[(launch.items.shape[0], kv_heads)](
            q, k, v, cos, sin, q_norm, k_norm, kv.k, kv.v, ks, vs, partial, lse, launch.items, plan.entry_rows,
            plan.entry_pos, plan.block_ids, plan.slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), stride_sb, stride_st,
            partial.stride(0), partial.stride(1), head_dim ** -0.5 * LOG2E, eps,
            NUM_HEADS=num_heads, GROUP=self.group, HEAD_DIM=head_dim, BS=kv.k.shape[1],
            BLOCK_M=max(16, triton_next_pow2(self.group)), BLOCK_N=plan.one_tile,
            HAS_NORM=norm_weights is not None, FP8=kv.k_scale is not None, INV_MAX=INV_FP8_MAX,
            SCALE_FLOOR=MIN_SCALE, IEEE=q.dtype == torch.float32, num_warps=self._one_tile_warps(),
            **UNFUSED_FLOAT_OPS, **pdl_arguments(q),
        )
        return self.merge(plan, q)

    def attend(self, plan: TritonPlan, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        self._check_group(q, kv)
        self.write_partials(plan, q, kv)
        return self.merge(plan, q)

    def write_partials(self, plan: TritonPlan, q: torch.Tensor, kv: LayerKV) -> list:
        """Every item's partial outputs and log-sum-exps into the plan's scratch (one launch per tile width).
        Returns what each launch returned (Triton's compiled kernels, whose registers, spills and shared memory
        benchmarks/tune_tree_attention.py --launches prints)."""
        num_heads, head_dim = q.shape[1:]
        kv_heads = kv.k.shape[2]
        partial, lse = self._scratch(plan, q)
        fp8 = kv.k_scale is not None
        ks, vs, stride_sb, stride_st = _scale_arguments(kv, partial)
        compiled = []
        for index, launch in enumerate(plan.launches):
            if launch.short:
                block_n, warps, stages = self.short_run_launch
            elif launch.block_m > 16:
                block_n, (warps, stages) = self.wide_block_n, self.wide_launch
            else:
                block_n, (warps, stages) = BLOCK_N, self.narrow_launch
            block_n = INTERPRET_BLOCK_N if interpreting() else block_n
            asked = (block_n, warps, stages)
            launch_tma = plan.reads_through_tma(launch)
            key = (q.device, q.dtype, kv.k.dtype, launch.block_m, asked, launch_tma)
            settings = self._fitted_launches.get(key, asked)
            while True:
                block_n, warps, stages = settings
                k_desc, v_desc = self._kv_descriptors(kv, block_n) if launch_tma else (None, None)
                try:
                    compiled.append(segment_attention_kernel[(launch.items.shape[0], kv_heads)](
                        q, kv.k, kv.v, ks, vs, partial, lse, launch.items, plan.entry_rows, plan.entry_pos,
                        plan.block_ids, k_desc, v_desc,
                        q.stride(0), q.stride(1), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
                        stride_sb, stride_st, partial.stride(0), partial.stride(1),
                        head_dim ** -0.5 * LOG2E,  # scores in the log2 domain
                        NUM_HEADS=num_heads, GROUP=self.group, HEAD_DIM=head_dim, BS=kv.k.shape[1],
                        BLOCK_M=launch.block_m, BLOCK_N=block_n, FP8=fp8, IEEE=q.dtype == torch.float32,
                        WAIT_AT_END=index > 0, TMA=launch_tma, num_warps=warps, num_stages=stages,
                        **pdl_arguments(q),
                    ))
                    break
                except OutOfResources as error:  # raised before launching: nothing ran
                    settings = smaller_launch(settings)
                    if settings is None:
                        raise RuntimeError(
                            f"the Triton attention's smallest launch for {launch.block_m}-row tiles of "
                            f"{str(q.dtype).removeprefix('torch.')} needs more {error.name} than this GPU has "
                            f"({error.required} bytes; the limit is {error.limit}). Use attention='torch-tree' (or "
                            f"'flashinfer' for a bf16 or fp16 model).") from error
            self._fitted_launches[key] = settings
        return compiled

    def _kv_descriptors(self, kv: LayerKV, block_n: int) -> tuple:
        """TMA descriptors of the layer's K and V caches seen as [slots, kv_heads x head_dim], with [block_n,
        head_dim] boxes. Made once per cache and width: a step's 32 layers x 2 would cost the host every step."""
        key = (kv.k.data_ptr(), kv.v.data_ptr(), tuple(kv.k.shape), kv.k.dtype, block_n)
        if key not in self._descriptors:
            blocks, block_size, kv_heads, head_dim = kv.k.shape
            self._descriptors[key] = tuple(
                TensorDescriptor.from_tensor(cache.view(blocks * block_size, kv_heads * head_dim), [block_n, head_dim])
                for cache in (kv.k, kv.v))
        return self._descriptors[key]

    def _check_group(self, q: torch.Tensor, kv: LayerKV) -> None:
        group = q.shape[1] // kv.k.shape[2]
        if group != self.group:  # tiles hold BLOCK_M // group rows, so the plan must know the group
            raise RuntimeError(f"the plan was made for {self.group} query heads per KV head, the model has "
                               f"{group}; call configure(num_heads, num_kv_heads) before planning.")

    def _scratch(self, plan: TritonPlan, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's partial outputs [slots, heads, head_dim] (float32, or q's dtype: low_precision_partials) and
        log2-sum-exps [slots, heads] (float32): made by the first layer (a graph's plan: by the warm-up, outside
        the graph's pool), reused by every layer."""
        scratch = plan.scratch
        if "out" not in scratch:
            num_heads, head_dim = q.shape[1:]
            dtype = q.dtype if self.low_precision_partials else torch.float32
            scratch["out"] = torch.empty(max(plan.num_slots, 1), num_heads, head_dim, dtype=dtype, device=q.device)
            scratch["lse"] = torch.empty(max(plan.num_slots, 1), num_heads, dtype=torch.float32, device=q.device)
        return scratch["out"], scratch["lse"]

    def merge(self, plan: TritonPlan, q: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim] in q's dtype: each token's partials (write_partials) combined."""
        tokens, num_heads, head_dim = q.shape
        partial, lse = plan.scratch["out"], plan.scratch["lse"]
        out = torch.empty_like(q)
        block_h, block_s, merge_warps = self.merge_block
        block_h = min(block_h, triton_next_pow2(num_heads))
        merge_partials_kernel[(tokens, triton.cdiv(num_heads, block_h))](
            partial, lse, plan.slot_indptr, plan.slots, out,
            partial.stride(0), partial.stride(1), out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_S=block_s, num_warps=merge_warps,
            **pdl_arguments(q),
        )
        return out

    def configure(self, num_heads: int, num_kv_heads: int, kv_dtype: torch.dtype | None = None) -> None:
        """Tell the planner the model's head layout (rows per tile depend on the GQA group size) and the cache's
        dtype (whether plans mark consecutive runs for TMA; None: they do not)."""
        self.group, self.num_kv_heads, self.kv_dtype = num_heads // num_kv_heads, num_kv_heads, kv_dtype


def _device_key(device: torch.device) -> torch.device:
    """One key for 'cuda' and the current 'cuda:N': plans get the engine's device, launches their tensors'."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def smaller_launch(settings: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """The next (BLOCK_N, num_warps, num_stages) to try after `settings` needed more shared memory than the GPU
    has: fewer pipeline stages first (each stage buffers a K and a V tile), then half the KV positions a step,
    down to (MIN_BLOCK_N, num_warps, 1); None past that."""
    block_n, warps, stages = settings
    if stages > 1:
        return block_n, warps, stages - 1
    if block_n > MIN_BLOCK_N:
        return block_n // 2, warps, 1
    return None


def _scale_arguments(kv: LayerKV, stand_in: torch.Tensor) -> tuple:
    """(k scales, v scales, block stride, slot stride) of an fp8 cache; for any other, a stand-in tensor that the
    kernels never read (FP8 is a constexpr) and zero strides."""
    if kv.k_scale is None:
        return stand_in, stand_in, 0, 0
    return kv.k_scale, kv.v_scale, kv.k_scale.stride(0), kv.k_scale.stride(1)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
