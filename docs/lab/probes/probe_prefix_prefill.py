"""Probe: a shared prefix's attention for all the leaves under it, as ONE prefill-shaped kernel from a library.

Under a shared prefix, every leaf's query row (times the query heads of a KV head) attends to the same keys: for
decode_step's (a) that is 64 leaves x 4 query heads = 256 rows per KV head against 4,096 keys, a small prefill
with no causal mask. The engine's Triton tree attention reads each shared page once, but its shared part runs at
about 2.6x the compute floor. This times the same work through library kernels built for prefill:

  - FlashInfer's BatchPrefillWithPagedKVCacheWrapper over the pages, backend fa2 and fa3 (Hopper), with the LSE
    that a merge with each leaf's own part needs;
  - torch's scaled_dot_product_attention over contiguous K/V (flash, cuDNN and memory-efficient backends), GQA.

Each is checked against float32 torch and printed next to the FLOP floor (4 x rows x keys x head_dim x heads /
the matmul rate measured here) and the bytes floor (the prefix's K/V once / copy bandwidth). Compare with
`tune_tree_attention.py --only default --launches`, which times the engine's launches on the same scenarios.

    python docs/lab/probes/probe_prefix_prefill.py

A probe, not an engine path: its figures are in docs/lab/gpu-fast-path.md. It needs a CUDA GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path
import dataclasses

import torch

# A lab probe (docs/lab/probes/README.md); the benchmark helpers it imports (bench_common and the scripts
# beside it) stay in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_common import kernel_seconds, log, measure_copy_bandwidth, measure_matmul_rate, parser  # noqa: E402
from bench_common import setup as make_setup  # noqa: E402

PAGE_TOKENS = 16
QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128   # Llama-3.1-8B


@dataclasses.dataclass(frozen=True)
class PrefixCase:
    label: str
    leaves: int          # query rows per query head: one per leaf
    prefix_tokens: int   # the shared keys

    def flops(self) -> float:
        return 4.0 * self.leaves * QUERY_HEADS * self.prefix_tokens * HEAD_DIM

    def kv_bytes(self) -> float:
        return 2.0 * self.prefix_tokens * KV_HEADS * HEAD_DIM * 2


CASES = [PrefixCase("(i) 256 leaves x 8,192", 256, 8192), PrefixCase("(a) 64 leaves x 4,096", 64, 4096),
         PrefixCase("(tot) 5 leaves x 576", 5, 576)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq, D] in float32, no mask."""
    group = QUERY_HEADS // KV_HEADS
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) / HEAD_DIM ** 0.5
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


def flashinfer_variants(case: PrefixCase, q, k, v, device):
    """(label, fn) for each FlashInfer backend that builds here; fn returns the output [T, Hq, D]."""
    import flashinfer

    pages = case.prefix_tokens // PAGE_TOKENS
    order = torch.randperm(pages, device=device, generator=torch.Generator(device).manual_seed(0))
    k_pages = torch.empty(pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM, dtype=k.dtype, device=device)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = k.view(pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM)   # scattered pages, as a pool holds them
    v_pages[order] = v.view(pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM)
    variants = []
    for backend in ("fa2", "fa3"):
        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        try:
            wrapper.plan(torch.tensor([0, case.leaves], dtype=torch.int32),
                         torch.tensor([0, pages], dtype=torch.int32), order.to(torch.int32),
                         torch.tensor([PAGE_TOKENS], dtype=torch.int32), QUERY_HEADS, KV_HEADS, HEAD_DIM,
                         PAGE_TOKENS, causal=False, q_data_type=q.dtype, kv_data_type=k.dtype)
            wrapper.run(q, (k_pages, v_pages), return_lse=True)
        except Exception as error:   # a backend this GPU or build lacks: say so, time the rest
            log(f"  flashinfer {backend}: unavailable ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            continue
        variants.append((f"flashinfer {backend}, paged", lambda w=wrapper: w.run(q, (k_pages, v_pages),
                                                                                   return_lse=True)[0]))
    return variants


def sdpa_variants(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))   # [1, H, T, D]
    variants = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
            return out.squeeze(0).transpose(0, 1)
        try:
            run()
        except Exception as error:
            log(f"  sdpa {name}: unavailable ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            continue
        variants.append((f"sdpa {name}, contiguous", run))
    return variants


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    setup = make_setup(args)
    device = setup.device
    if device.type != "cuda":
        raise SystemExit("probe_prefix_prefill.py times GPU kernels: run it on a GPU.")
    matmul = measure_matmul_rate(device, torch.bfloat16)
    copy = measure_copy_bandwidth(device)
    log(f"floors here: matmul {matmul / 1e12:,.0f} TFLOP/s, copy {copy / 1e9:,.0f} GB/s")
    log(f"{'case':>24}  {'kernel':>28}  {'us':>8}  {'floor us':>8}  {'x floor':>7}  {'TFLOP/s':>7}  {'rel err':>7}")
    for case in CASES:
        generator = torch.Generator(device).manual_seed(1)
        q = torch.randn(case.leaves, QUERY_HEADS, HEAD_DIM, device=device, generator=generator).to(torch.bfloat16)
        k, v = (torch.randn(case.prefix_tokens, KV_HEADS, HEAD_DIM, device=device, generator=generator)
                .to(torch.bfloat16) for _ in range(2))
        expected = reference(q, k, v)
        floor = max(case.flops() / matmul, case.kv_bytes() / copy)
        for label, fn in flashinfer_variants(case, q, k, v, device) + sdpa_variants(q, k, v):
            error = relative_error(fn(), expected)
            seconds = kernel_seconds(fn, device)
            log(f"{case.label:>24}  {label:>28}  {seconds * 1e6:8.1f}  {floor * 1e6:8.1f}  {seconds / floor:7.2f}  "
                f"{case.flops() / seconds / 1e12:7.0f}  {error:7.1e}")


if __name__ == "__main__":
    main()
