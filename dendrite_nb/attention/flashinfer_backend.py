"""FlashInfer paged attention: every row reads its own block table (flat; BatchLayout.segments is ignored).

FlashInfer is imported inside methods only, so this module loads on a machine without it or without CUDA;
`unavailable_reason` says why it cannot run there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from .base import BatchLayout, Capabilities, LayerKV

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k scratch; one per device, shared by all wrappers
HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer builds its attention kernels for
TENSOR_CORE_GROUP = 4  # GQA group size from which FlashInfer's tensor-core decode beats its CUDA-core one


class PageTables(NamedTuple):
    """One forward's page tables in FlashInfer's CSR form: host lists from page_tables(), or int32 tensors."""

    qo_indptr: Sequence[int]  # [B + 1] first new token of each sequence, then T
    kv_indptr: Sequence[int]  # [B + 1] first page of each sequence in kv_indices, then the page count
    kv_last_page_len: Sequence[int]  # [B] tokens in each sequence's last page, 1..block_size
    batch_indices: Sequence[int]  # [T] sequence of each new token
    positions: Sequence[int]  # [T] context position each new token is written to
    kv_indices: Sequence[int]  # [pages] physical block of each page, sequence after sequence


def page_tables(layout: BatchLayout, block_size: int) -> PageTables:
    """CSR tables for the contexts after this forward's tokens are written (what append and attention read)."""
    qo_indptr, kv_indptr, kv_indices, last_page_len, batch_indices = [0], [0], [], [], []
    for row, (q_len, kv_len, table) in enumerate(zip(layout.q_lens, layout.kv_lens, layout.block_tables)):
        pages = -(-kv_len // block_size)
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indices.extend(table[:pages])
        kv_indptr.append(len(kv_indices))
        last_page_len.append(kv_len - (pages - 1) * block_size)
        batch_indices.extend([row] * q_len)
    # What flashinfer.get_batch_indices_positions computes on the GPU, here on the host with no extra launch.
    return PageTables(qo_indptr, kv_indptr, last_page_len, batch_indices, layout.positions, kv_indices)


@dataclass(slots=True)
class FlashInferPlan:
    block_size: int
    is_decode: bool  # every q_len is 1: the decode wrapper, else the causal prefill wrapper
    host: PageTables  # pinned int32 slices; the wrappers' plan() reads these without a device sync
    gpu: PageTables  # the same on the device, for append_paged_kv_cache
    wrapper: Any = None  # the wrapper planned for this forward, set by layer 0's attend()


class FlashInferAttention:
    name = "flashinfer"
    capabilities = Capabilities()  # flat paged attention and FlashInfer's own plans: none of the optional calls

    def __init__(self):
        import flashinfer  # make_backend builds this only after unavailable_reason() found it importable

        self._flashinfer = flashinfer
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._wrappers: dict[tuple[torch.device, bool, bool], Any] = {}  # (device, decode, tensor cores) -> wrapper
        self._planned: FlashInferPlan | None = None  # the plan the wrappers were last planned for

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, kv_dtype) -> str | None:
        if device.type != "cuda":
            return "FlashInfer runs on CUDA GPUs only"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashInfer needs a float16 or bfloat16 model, not {str(dtype).removeprefix('torch.')}"
        if kv_dtype != dtype:
            return "this backend keeps the KV cache in the model's dtype; another backend handles a quantised KV cache"
        if head_dim not in HEAD_DIMS:
            return f"FlashInfer's kernels take head_dim {' / '.join(map(str, HEAD_DIMS))}, not {head_dim}"
        try:
            import flashinfer  # noqa: F401
        except Exception as error:  # not installed, or installed without a dependency (e.g. tvm_ffi)
            return f"`import flashinfer` failed ({type(error).__name__}: {error}); `pip install flashinfer-python`"
        return None

    def plan(self, layout: BatchLayout, block_size: int, device: torch.device) -> FlashInferPlan:
        tables = page_tables(layout, block_size)
        sizes = [len(table) for table in tables]
        # One pinned buffer and one async copy for all six tables; the plan keeps `host` alive past the copy.
        host = torch.tensor([i for table in tables for i in table], dtype=torch.int32).pin_memory()
        gpu = host.to(device, non_blocking=True)
        return FlashInferPlan(block_size, layout.is_decode, PageTables(*host.split(sizes)),
                              PageTables(*gpu.split(sizes)))

    def append_kv(self, plan: FlashInferPlan, kv: LayerKV, k, v) -> None:
        self._flashinfer.page.append_paged_kv_cache(
            # contiguous: on the fused path k and v are strided views into the qkv projection
            k.to(kv.k.dtype).contiguous(), v.to(kv.v.dtype).contiguous(), plan.gpu.batch_indices, plan.gpu.positions, (kv.k, kv.v),
            plan.gpu.kv_indices, plan.gpu.kv_indptr, plan.gpu.kv_last_page_len, kv_layout="NHD")

    def attend(self, plan: FlashInferPlan, q, kv: LayerKV) -> torch.Tensor:
        # The wrappers' plan() needs the head counts, which only q and the cache carry: layer 0 plans, and the
        # later layers of the same forward reuse it. Another plan run in between (not the engine's way) re-plans.
        if self._planned is not plan:
            plan.wrapper = self._plan_wrapper(plan, q, kv)
            self._planned = plan
        return plan.wrapper.run(q.contiguous(), (kv.k, kv.v))  # [T, heads, head_dim] in q's dtype, scale head_dim ** -0.5

    def _plan_wrapper(self, plan: FlashInferPlan, q: torch.Tensor, kv: LayerKV) -> Any:
        heads, head_dim = q.shape[1:]
        kv_heads = kv.k.shape[2]
        tensor_cores = plan.is_decode and heads // kv_heads >= TENSOR_CORE_GROUP
        wrapper = self._wrapper(q.device, plan.is_decode, tensor_cores)
        host = plan.host
        if plan.is_decode:
            wrapper.plan(host.kv_indptr, host.kv_indices, host.kv_last_page_len, heads, kv_heads, head_dim,
                         plan.block_size, q_data_type=q.dtype, kv_data_type=kv.k.dtype)
        else:  # causal aligns each sequence's queries with the end of its context, as the torch reference does
            wrapper.plan(host.qo_indptr, host.kv_indptr, host.kv_indices, host.kv_last_page_len, heads, kv_heads,
                         head_dim, plan.block_size, causal=True, q_data_type=q.dtype, kv_data_type=kv.k.dtype)
        return wrapper

    def _wrapper(self, device: torch.device, decode: bool, tensor_cores: bool) -> Any:
        key = (device, decode, tensor_cores)
        if key not in self._wrappers:
            if device not in self._workspaces:  # FlashInfer asks for zeros on first use
                self._workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            workspace = self._workspaces[device]
            if decode:
                self._wrappers[key] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=tensor_cores)
            else:
                self._wrappers[key] = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        return self._wrappers[key]
