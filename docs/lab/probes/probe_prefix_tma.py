"""Probe: does a shared prefix's attention run faster when its K/V tiles come through TMA (tensor descriptors)?

The engine's tree attention reads a shared prefix once for every leaf under it, a [rows x query heads, head_dim]
tile against the prefix's keys, cut into chunks that fill the GPU. Its loads are pointer loads through the block
table: each thread computes the address of every 16 bytes it copies (cp.async). On Hopper a tile can instead
be one TMA copy, issued by one thread, which frees the registers and instructions of the addresses. A TMA box
needs the tile's positions to lie at one stride in memory: true for a prefix whose blocks are consecutive in
the pool, as a prefix prefilled into a fresh pool's free list is.

This times one kernel over the prefix chunks of decode_step's (a) and tree_attention's (i), in three ways to load
K and V (the rest is the same code):
  - `table`: pointer loads through the block table, as the engine's segment kernel does;
  - `linear`: pointer loads at consecutive slots (the block table read once, for the first block);
  - `tma`: the tile loaded through a host-built TensorDescriptor over the pool's [slots, kv_heads x head_dim] view;
  - `dtma`, `tma_ws`, `dtma_ws` (not run unless asked): descriptors built on the device, and the KV loop warp
    specialised by Triton, with host or device descriptors.
Each writes float32 partials and log-sum-exps as the engine does; the partials merged in torch are checked
against float32 attention. Figures: us and TFLOP/s next to the FLOP floor (4 x rows x keys x head_dim x heads /
the matmul rate measured here) and the bytes floor (the prefix's K/V once / copy bandwidth). Compare with
`tune_tree_attention.py --only default --launches`, which times the engine's own launches on the same layouts.

    python docs/lab/probes/probe_prefix_tma.py [--modes table linear tma dtma tma_ws dtma_ws] [--launches 4,3,64 ...]

A probe, not an engine path: its figures are in docs/lab/gpu-sessions-23-26.md. With --smoke it runs small shapes in
Triton's CPU interpreter (a CI check of the three load paths).
"""
from __future__ import annotations

import sys
from pathlib import Path
import dataclasses
import functools
import itertools
import math

import torch
import triton
import triton.language as tl

# A lab probe (docs/lab/probes/README.md); the benchmark helpers it imports (bench_common and the scripts
# beside it) stay in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_common import kernel_seconds, log, measure_copy_bandwidth, measure_matmul_rate, parser  # noqa: E402
from bench_common import setup as make_setup  # noqa: E402

LOG2E = 1.4426950408889634
MODES = {"table": 0, "linear": 1, "tma": 2, "dtma": 3, "tma_ws": 4, "dtma_ws": 5}
# Modes 3-5: device-side descriptors (`tl.make_tensor_descriptor`, built inside the kernel) and Triton's warp
# specialisation of the KV loop (a producer warp issues the TMA copies while the others compute). Triton enables
# warp specialisation on Hopper only for some loops, and its notes say with device-side descriptors; a mode that
# does not compile is reported as failed.
DEVICE_DESCRIPTOR_MODES = (3, 5)
WARP_SPECIALISED_MODES = (4, 5)
# (num_warps, num_stages, BLOCK_N); the engine's wide launch is (4, 3) with BLOCK_N 64.
DEFAULT_LAUNCHES = ((4, 3, 64), (8, 3, 64), (4, 4, 64), (8, 2, 128), (4, 3, 32))


@dataclasses.dataclass(frozen=True)
class PrefixCase:
    label: str
    leaves: int          # one query row per leaf and query head
    prefix_tokens: int   # the shared keys
    chunks: int          # how many pieces the prefix is cut into (the engine's plan for this layout)
    query_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def group(self) -> int:
        return self.query_heads // self.kv_heads

    def flops(self) -> float:
        return 4.0 * self.leaves * self.query_heads * self.prefix_tokens * self.head_dim

    def kv_bytes(self, element_bytes: int) -> float:
        return 2.0 * self.prefix_tokens * self.kv_heads * self.head_dim * element_bytes


# (a): decode_step's 8B layout (64 leaves under 4,096 tokens; the engine cuts it into 16 chunks of 256 for 2 x 128-row
# tiles x 8 KV heads); (i): tree_attention's 256 leaves under 8,192 tokens (8 row tiles, 4 chunks of 2,048).
CASES = (PrefixCase("(a) 64 leaves x 4,096", 64, 4096, 16), PrefixCase("(i) 256 leaves x 8,192", 256, 8192, 4))
SMOKE_CASES = (PrefixCase("smoke", 8, 64, 2, query_heads=4, kv_heads=2, head_dim=16),)


@triton.jit
def prefix_chunk_kernel(Q, K, V, K_DESC, V_DESC, BLOCK_IDS, OUT_P, LSE_P,
                        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, chunk_tokens, qk_scale, total_slots,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, MODE: tl.constexpr,
                        DEVICE_DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Program (row tile x chunk, KV head): BLOCK_M query vectors (BLOCK_M // GROUP leaves x the KV head's GROUP
    query heads) over one chunk of the prefix; writes each vector's normalised partial and log2-sum-exp into slot
    leaf * NUM_CHUNKS + chunk. Every row sees every prefix position: no masks, as a shared prefix's steps run."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_tile = tile // NUM_CHUNKS
    chunk = tile % NUM_CHUNKS
    m = tl.arange(0, BLOCK_M)
    leaf = row_tile * (BLOCK_M // GROUP) + m // GROUP
    head = kv_head * GROUP + m % GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + leaf[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :])
    first_slot = tl.load(BLOCK_IDS).to(tl.int64) * BS  # `linear` and `tma`: the prefix's blocks are consecutive
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start0 = chunk * chunk_tokens
    if DEVICE_DESCRIPTORS:
        K_DESC = tl.make_tensor_descriptor(K, shape=[total_slots, NUM_KV_HEADS * HEAD_DIM],
                                           strides=[NUM_KV_HEADS * HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        V_DESC = tl.make_tensor_descriptor(V, shape=[total_slots, NUM_KV_HEADS * HEAD_DIM],
                                           strides=[NUM_KV_HEADS * HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    for start in tl.range(start0, start0 + chunk_tokens, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        pos = start + tl.arange(0, BLOCK_N)
        if MODE == 0:
            block = tl.load(BLOCK_IDS + pos // BS)
            slot = block.to(tl.int64) * stride_kb + (pos % BS) * stride_kt + kv_head * stride_kh
            k = tl.load(K + slot[:, None] + d[None, :])
            v = tl.load(V + slot[:, None] + d[None, :])
        elif MODE == 1:
            slot = (first_slot + pos) * stride_kt + kv_head * stride_kh
            k = tl.load(K + slot[:, None] + d[None, :])
            v = tl.load(V + slot[:, None] + d[None, :])
        else:
            row = (first_slot + start).to(tl.int32)
            k = K_DESC.load([row, kv_head * HEAD_DIM])
            v = V_DESC.load([row, kv_head * HEAD_DIM])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    slot_of = (leaf * NUM_CHUNKS + chunk).to(tl.int64)
    tl.store(OUT_P + slot_of[:, None] * (NUM_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + d[None, :], out)
    tl.store(LSE_P + slot_of * NUM_HEADS + head, m_i + tl.math.log2(l_i))


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor            # [leaves, query heads, head_dim]
    k_cache: torch.Tensor      # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_ids: torch.Tensor    # [prefix blocks] int32, consecutive
    out_p: torch.Tensor        # [leaves x chunks, query heads, head_dim] float32
    lse_p: torch.Tensor        # [leaves x chunks, query heads] float32


def make_inputs(case: PrefixCase, device: torch.device, dtype: torch.dtype) -> Inputs:
    generator = torch.Generator().manual_seed(0)
    blocks = case.prefix_tokens // case.block_size
    first = 3  # not block 0, so a kernel that ignored the table's first entry would read the wrong keys
    shape = (first + blocks + 1, case.block_size, case.kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=generator).to(device, dtype)
    v_cache = torch.randn(shape, generator=generator).to(device, dtype)
    q = torch.randn(case.leaves, case.query_heads, case.head_dim, generator=generator).to(device, dtype)
    block_ids = torch.arange(first, first + blocks, dtype=torch.int32, device=device)
    slots = case.leaves * case.chunks
    out_p = torch.empty(slots, case.query_heads, case.head_dim, device=device)
    lse_p = torch.empty(slots, case.query_heads, device=device)
    return Inputs(q, k_cache, v_cache, block_ids, out_p, lse_p)


def descriptors(case: PrefixCase, inputs: Inputs, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor
    width = case.kv_heads * case.head_dim
    views = [cache.view(-1, width) for cache in (inputs.k_cache, inputs.v_cache)]
    return [TensorDescriptor.from_tensor(view, [block_n, case.head_dim]) for view in views]


def _descriptor_scratch(size: int, alignment: int, stream):
    """Global scratch that Triton asks for where a kernel builds tensor descriptors on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def launch(case: PrefixCase, inputs: Inputs, mode: str, num_warps: int, num_stages: int, block_n: int,
           block_m: int = 128) -> None:
    block_m = min(block_m, case.leaves * case.group)
    chunk_tokens = case.prefix_tokens // case.chunks
    if chunk_tokens % block_n:
        raise ValueError(f"chunks of {chunk_tokens} tokens are not whole {block_n}-position steps")
    k_desc, v_desc = descriptors(case, inputs, block_n) if mode in ("tma", "tma_ws") else (None, None)
    grid = (case.leaves * case.group // block_m * case.chunks, case.kv_heads)
    k = inputs.k_cache
    prefix_chunk_kernel[grid](
        inputs.q, k, inputs.v_cache, k_desc, v_desc, inputs.block_ids, inputs.out_p, inputs.lse_p,
        inputs.q.stride(0), inputs.q.stride(1), k.stride(0), k.stride(1), k.stride(2), chunk_tokens,
        case.head_dim ** -0.5 * LOG2E, k.shape[0] * k.shape[1],
        NUM_HEADS=case.query_heads, NUM_KV_HEADS=case.kv_heads, GROUP=case.group, HEAD_DIM=case.head_dim, BS=case.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_CHUNKS=case.chunks, MODE=MODES[mode],
        DEVICE_DESCRIPTORS=MODES[mode] in DEVICE_DESCRIPTOR_MODES,
        WARP_SPECIALIZE=MODES[mode] in WARP_SPECIALISED_MODES,
        num_warps=num_warps, num_stages=num_stages)


def relative_error(case: PrefixCase, inputs: Inputs) -> float:
    """The partials merged by log-sum-exp against float32 attention of every query vector over the prefix."""
    out_p = inputs.out_p.view(case.leaves, case.chunks, case.query_heads, case.head_dim)
    lse_p = inputs.lse_p.view(case.leaves, case.chunks, case.query_heads)
    weights = torch.softmax(lse_p / LOG2E, dim=1)  # log2 domain -> natural
    merged = (out_p * weights[..., None]).sum(1)  # [leaves, heads, D]
    blocks = inputs.block_ids.long()
    keys = inputs.k_cache[blocks].flatten(0, 1).float()  # [prefix, kv_heads, D]
    values = inputs.v_cache[blocks].flatten(0, 1).float()
    keys = keys.repeat_interleave(case.group, dim=1)
    values = values.repeat_interleave(case.group, dim=1)
    scores = torch.einsum("lhd,phd->hlp", inputs.q.float(), keys) * case.head_dim ** -0.5
    want = torch.einsum("hlp,phd->lhd", torch.softmax(scores, dim=-1), values)
    return ((merged - want).norm() / want.norm()).item()


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--modes", nargs="+", choices=list(MODES), default=["table", "linear", "tma"],
                           help="load paths to time; dtma / tma_ws / dtma_ws are the warp-specialisation trials "
                                "(docs/lab/gpu-sessions-23-26.md: no gain on the H200, and 4-warp launches fail to "
                                "compile there)")
    arguments.add_argument("--chunks", nargs="+", type=int, default=None,
                           help="cut each case's prefix into these numbers of chunks (default: the engine's plan)")
    arguments.add_argument("--block-m", nargs="+", type=int, default=[128],
                           help="query vectors per program (the engine's widest tile: 128)")
    arguments.add_argument("--launches", nargs="+", default=None, metavar="WARPS,STAGES,BLOCK_N",
                           help=f"launch settings to sweep (default {' '.join(','.join(map(str, s)) for s in DEFAULT_LAUNCHES)})")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    launches = ([tuple(int(x) for x in text.split(",")) for text in args.launches] if args.launches else
                [(4, 1, 16)] if setup.smoke else list(DEFAULT_LAUNCHES))
    cases = SMOKE_CASES if setup.smoke else CASES
    if args.chunks:
        cases = [dataclasses.replace(case, chunks=chunks) for case in cases for chunks in args.chunks]
    device, dtype = setup.device, setup.dtype
    if any(MODES[mode] in DEVICE_DESCRIPTOR_MODES for mode in args.modes):
        triton.set_allocator(_descriptor_scratch)  # where those kernels build their descriptors
    timed = device.type == "cuda"
    if timed:
        bandwidth = measure_copy_bandwidth(device)
        matmul = measure_matmul_rate(device, dtype)
        log(f"floors: copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write), matmul {matmul / 1e12:,.0f} TFLOP/s")
    for case in cases:
        inputs = make_inputs(case, device, dtype)
        if timed:
            flop_floor = case.flops() / matmul
            byte_floor = case.kv_bytes(inputs.k_cache.element_size()) / (bandwidth / 2)
            log(f"{case.label}, {case.chunks} chunks: FLOP floor {flop_floor * 1e6:.1f} us, bytes floor {byte_floor * 1e6:.1f} us")
        log(f"{'mode':>8} {'rows':>5} {'warps,stages,n':>15} {'us':>8} {'TFLOP/s':>8} {'x FLOP floor':>12} {'rel. error':>10}")
        for mode, block_m, (warps, stages, block_n) in itertools.product(args.modes, args.block_m, launches):
            run = functools.partial(launch, case, inputs, mode, warps, stages, block_n, block_m)
            try:
                inputs.out_p.fill_(math.nan)
                run()
                error = relative_error(case, inputs)
                seconds = kernel_seconds(run, device) if timed else math.nan
            except Exception as failure:  # a setting that does not compile or fit: say so, go on
                log(f"{mode:>8} {block_m:5} {f'{warps},{stages},{block_n}':>15}  failed: {str(failure).splitlines()[0][:120]}")
                continue
            rate = case.flops() / seconds / 1e12 if timed else math.nan
            ratio = seconds / flop_floor if timed else math.nan
            log(f"{mode:>8} {block_m:5} {f'{warps},{stages},{block_n}':>15} {seconds * 1e6:8.1f} {rate:8.0f} {ratio:12.2f} "
                f"{error:10.1e}")
            if error > 2e-2:
                raise SystemExit(f"{mode} {warps},{stages},{block_n} on {case.label}: relative error {error:.1e}")


if __name__ == "__main__":
    main()
