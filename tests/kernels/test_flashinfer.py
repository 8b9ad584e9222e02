"""The FlashInfer backend: its page tables and refusal on the CPU; parity with the torch reference on a GPU."""
import re

import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.attention import BatchLayout, LayerKV, TorchAttention, make_backend, unavailable_reason
from dendrite_nb.attention.flashinfer_backend import FlashInferAttention, page_tables

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
BLOCK = 16
# A decode batch whose first two rows share blocks 0 and 1 (a forked prefix), each writing its own tail block.
DECODE = BatchLayout(q_lens=[1, 1, 1, 1], kv_lens=[37, 40, 17, 1], block_tables=[[0, 1, 2], [0, 1, 3], [4, 5], [6]])
# A prefill batch: the first two rows read shared block 0 and write from mid-block (positions 22 and 25); the
# third is a fresh sequence. Its tables carry a spare block past the context, which must not be read.
PREFILL = BatchLayout(q_lens=[5, 20, 3], kv_lens=[27, 45, 3], block_tables=[[0, 7], [0, 8, 9], [10, 11]])
HF_CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "max_position_embeddings": 4096}
FLASHINFER_REASON = unavailable_reason("flashinfer", torch.device("cuda"), torch.bfloat16, 128)
# On a machine without CUDA the gpu mark skips these (conftest); with CUDA but no usable FlashInfer, this does.
needs_flashinfer = pytest.mark.skipif(torch.cuda.is_available() and FLASHINFER_REASON is not None,
                                      reason=f"FlashInfer cannot run here: {FLASHINFER_REASON}")


def test_page_tables_are_the_csr_form_of_the_block_tables():
    tables = page_tables(PREFILL, BLOCK)
    assert tables.qo_indptr == [0, 5, 25, 28]
    assert tables.kv_indptr == [0, 2, 5, 6]  # the spare block 11 is left out: 3 tokens fill one page
    assert tables.kv_indices == [0, 7, 0, 8, 9, 10]
    assert tables.kv_last_page_len == [11, 13, 3]
    assert tables.batch_indices == [0] * 5 + [1] * 20 + [2] * 3
    assert tables.positions == [*range(22, 27), *range(25, 45), 0, 1, 2]


def test_cpu_is_refused_with_a_reason():
    reason = FlashInferAttention.unavailable_reason(torch.device("cpu"), torch.bfloat16, 128, torch.bfloat16)
    assert reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        make_backend("flashinfer", "cpu", torch.bfloat16)


def run_layers(backend, layout: BatchLayout, caches: list[LayerKV], q, k, v) -> torch.Tensor:
    """One forward as the engine drives it: plan once, then append and attend per layer -> [L, T, heads, dim]."""
    plan = backend.plan(layout, BLOCK, q.device)
    outputs = []
    for layer, kv in enumerate(caches):
        backend.append_kv(plan, kv, k[layer], v[layer])
        outputs.append(backend.attend(plan, q[layer], kv))
    return torch.stack(outputs)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("layout", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("heads", [8, 2], ids=["gqa4", "gqa1"])  # group 4 takes the tensor-core decode kernel
def test_matches_torch_reference(layout, heads):
    layers, kv_heads, head_dim, tokens = 2, 2, 128, sum(layout.q_lens)
    gen = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    pool = randn(layers, 2, 12, BLOCK, kv_heads, head_dim)  # the contexts already in the cache
    q = randn(layers, tokens, heads, head_dim)
    k, v = randn(layers, tokens, kv_heads, head_dim), randn(layers, tokens, kv_heads, head_dim)
    pools = {"flashinfer": pool.clone(), "torch": pool.clone()}
    out = {name: run_layers(backend, layout, [LayerKV(p[0], p[1]) for p in pools[name]], q, k, v)
           for name, backend in (("flashinfer", FlashInferAttention()), ("torch", TorchAttention()))}
    assert torch.equal(pools["flashinfer"], pools["torch"]), "the new tokens' k, v were written to other slots"
    assert out["flashinfer"].dtype == torch.bfloat16 and out["flashinfer"].shape == (layers, tokens, heads, head_dim)
    error = (out["flashinfer"].float() - out["torch"].float()).norm() / out["torch"].float().norm()
    assert error < 1e-2


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("layout", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_a_forward_never_waits_for_the_gpu(layout):
    caches = [LayerKV(p[0], p[1]) for p in torch.zeros(2, 2, 12, BLOCK, 2, 128, device="cuda", dtype=torch.bfloat16)]
    tokens = sum(layout.q_lens)
    q, k, v = (torch.ones(2, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for heads in (8, 2, 2))
    backend = FlashInferAttention()
    run_layers(backend, layout, caches, q, k, v)  # builds the kernels and the workspace, which may synchronise
    torch.cuda.set_sync_debug_mode("error")  # a later forward must queue its work without waiting for the GPU
    try:
        run_layers(backend, layout, caches, q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.mark.gpu
@needs_flashinfer
def test_engine_matches_torch_backend():
    # Chunks of 24 tokens make the second prefill forward start mid-block, on top of cached context.
    engines = [Engine.from_random(HF_CONFIG, device="cuda", dtype="bfloat16", attention=name, num_blocks=64,
                                  prefill_chunk_tokens=24) for name in ("flashinfer", "torch")]
    prompt = torch.randint(0, HF_CONFIG["vocab_size"], (45,), generator=torch.Generator().manual_seed(0)).tolist()
    fast, reference = (eng.new_branch("a", prompt) for eng in engines)
    assert cosine(engines[0].next_logits([fast]), engines[1].next_logits([reference])) > 0.99
    # bf16 rounding may flip a greedy token, so the reference is fed FlashInfer's tokens: both then score
    # the same context, FlashInfer after 16 decode steps and the reference after one prefill.
    generated = engines[0].generate([fast], 16, GREEDY)[0]
    engines[1].append(reference, generated)
    assert cosine(engines[0].next_logits([fast]), engines[1].next_logits([reference])) > 0.99
    for eng in engines:
        eng.audit()


@pytest.mark.gpu
@needs_flashinfer
def test_fork_matches_linear_runs():
    eng = Engine.from_random(HF_CONFIG, device="cuda", dtype="bfloat16", attention="flashinfer", num_blocks=64,
                             debug=True)
    prompt = list(range(1, 22))
    trunk = eng.new_branch("trunk", prompt)
    assert len(trunk) % BLOCK != 0, "the fork point must be mid-block so the children copy the shared tail block"
    kids = eng.fork(trunk, 4)
    batched = eng.generate(kids, 8, GREEDY)
    # Linear runs prefilled one at a time and decoded in one batch of 4: the same GEMM shapes as the children,
    # so any difference comes from reading shared or copied blocks, and tokens and logits must agree exactly.
    linear = [eng.new_branch(f"linear{i}", prompt) for i in range(4)]
    assert eng.generate(linear, 8, GREEDY) == batched
    assert torch.equal(eng.next_logits(linear), eng.next_logits(kids))
    eng.audit()
