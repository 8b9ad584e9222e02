"""The fused Triton kernels against the torch reference they replace.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, in float32 (the interpreter mishandles
bfloat16); with CUDA the same tests run on the GPU, and the `gpu` tests add bfloat16 and real sizes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before the import below

pytest.importorskip("triton")

from torch.nn import functional as F  # noqa: E402

from dendrite_nb import kernels  # noqa: E402
from dendrite_nb.model.config import ModelConfig  # noqa: E402
from dendrite_nb.model.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dendrite_nb.model.transformer import RMSNorm  # noqa: E402
from dendrite_nb.testing import TINY_SHAPES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT32_TOL, ROPE_FLOAT32_TOL, BF16_TOL = 1e-5, 1e-6, 1e-2  # max relative error, against the largest reference value


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 GEMMs would hide the kernels' float32 error
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up in the comparison."""
    return torch.full_like(tensor, float("nan"))


def random(*shape, dtype=torch.float32, seed=0, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def reference_norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def rope_table(head_dim: int, tokens: int, dtype=torch.float32, device=DEVICE):
    """cos, sin [tokens, head_dim] at scattered positions up to 100k (large angles), llama3-scaled frequencies."""
    config = ModelConfig.from_hf(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256, head_dim=head_dim))
    positions = torch.randint(0, 100_000, (tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    return rope_cos_sin(rope_inv_freq(config, device), positions, dtype)


# ---- each kernel against its reference (float32; the interpreter without CUDA) ------------------------------
def test_rms_norm_matches_reference_on_strided_rows():
    wide = random(5, 110)
    x = wide[:, 7:103]  # [5, 96], rows 110 apart
    weight = random(96, seed=1)
    out = kernels.rms_norm(x, weight, 1e-5, out=poisoned_like(x))
    assert rel_err(out, reference_norm(weight, 1e-5)(x)) < FLOAT32_TOL


def test_add_rms_norm_returns_normed_sum_and_the_sum():
    x, residual, weight = random(5, 96), random(5, 96, seed=1), random(96, seed=2)
    normed, summed = kernels.add_rms_norm(x, residual, weight, 1e-6, out=(poisoned_like(x), poisoned_like(x)))
    assert torch.equal(summed, x + residual)  # the residual stream is the reference's own sum, bit for bit
    assert rel_err(normed, reference_norm(weight, 1e-6)(x + residual)) < FLOAT32_TOL


@pytest.mark.parametrize("head_dim", [16, 24, 32])  # 24: a half (12) that is not a power of two
def test_rope_rotates_q_and_k_like_apply_rope(head_dim):
    q, k = random(5, 3, head_dim), random(5, 1, head_dim, seed=1)
    q_in, k_in = q.clone(), k.clone()
    cos, sin = rope_table(head_dim, 5)
    q_out, k_out = kernels.rope_qk(q, k, cos, sin, out=(poisoned_like(q), poisoned_like(k)))
    assert rel_err(q_out, apply_rope(q, cos, sin)) < ROPE_FLOAT32_TOL
    assert rel_err(k_out, apply_rope(k, cos, sin)) < ROPE_FLOAT32_TOL
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # out of place leaves the inputs alone


def test_rope_in_place_on_views_of_one_qkv_tensor_leaves_v_alone():
    heads, kv_heads, head_dim = 3, 2, 16
    qkv = random(5, (heads + 2 * kv_heads) * head_dim).view(5, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # as Attention.forward_fused makes them
    expected_q, expected_k = q.clone(), k.clone()
    v_before = v.clone()
    cos, sin = rope_table(head_dim, 5)
    kernels.rope_qk(q, k, cos, sin, out=(q, k))
    assert rel_err(q, apply_rope(expected_q, cos, sin)) < ROPE_FLOAT32_TOL
    assert rel_err(k, apply_rope(expected_k, cos, sin)) < ROPE_FLOAT32_TOL
    assert torch.equal(v, v_before)


def test_rope_with_qwen3_qk_norm_matches_norm_then_rope():
    q, k = random(5, 3, 32), random(5, 1, 32, seed=1)
    q_weight, k_weight = random(32, seed=2), random(32, seed=3)
    cos, sin = rope_table(32, 5)
    q_out, k_out = kernels.rope_qk(q, k, cos, sin, out=(poisoned_like(q), poisoned_like(k)),
                                   norm_weights=(q_weight, k_weight), eps=1e-6)
    assert rel_err(q_out, apply_rope(reference_norm(q_weight, 1e-6)(q), cos, sin)) < ROPE_FLOAT32_TOL
    assert rel_err(k_out, apply_rope(reference_norm(k_weight, 1e-6)(k), cos, sin)) < ROPE_FLOAT32_TOL


def test_silu_mul_matches_silu_gate_times_up():
    width = 1500  # two column blocks, the second one partial
    gate_up = random(3, 2 * width) * 4
    out = kernels.silu_mul(gate_up, out=poisoned_like(gate_up[:, :width]))
    assert rel_err(out, F.silu(gate_up[:, :width]) * gate_up[:, width:]) < FLOAT32_TOL


def test_rope_refuses_a_table_of_another_dtype():
    q, k = random(5, 3, 16), random(5, 1, 16, seed=1)
    cos, sin = rope_table(16, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="from rope_cos_sin"):
        kernels.rope_qk(q, k, cos, sin)


# ---- GPU only: bfloat16, real sizes, CUDA graphs ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, BF16_TOL), (torch.float32, FLOAT32_TOL)])
def test_kernels_match_reference_on_cuda_at_real_sizes(dtype, tol):
    tokens, hidden, heads, kv_heads, head_dim, intermediate = 37, 4096, 32, 8, 128, 14336
    x, residual, weight = random(tokens, hidden, dtype=dtype), random(tokens, hidden, dtype=dtype, seed=1), \
        random(hidden, dtype=dtype, seed=2)
    norm = reference_norm(weight, 1e-5)
    assert rel_err(kernels.rms_norm(x, weight, 1e-5), norm(x)) < tol
    normed, summed = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    assert rel_err(normed, norm(x + residual)) < tol

    q, k = random(tokens, heads, head_dim, dtype=dtype), random(tokens, kv_heads, head_dim, dtype=dtype, seed=1)
    cos, sin = rope_table(head_dim, tokens, dtype=dtype)
    q_out, k_out = kernels.rope_qk(q, k, cos, sin)
    assert rel_err(q_out, apply_rope(q, cos, sin)) < tol and rel_err(k_out, apply_rope(k, cos, sin)) < tol
    q_weight, k_weight = random(head_dim, dtype=dtype, seed=3), random(head_dim, dtype=dtype, seed=4)
    q_out, k_out = kernels.rope_qk(q, k, cos, sin, norm_weights=(q_weight, k_weight), eps=1e-6)
    assert rel_err(q_out, apply_rope(reference_norm(q_weight, 1e-6)(q), cos, sin)) < tol
    assert rel_err(k_out, apply_rope(reference_norm(k_weight, 1e-6)(k), cos, sin)) < tol

    gate_up = random(tokens, 2 * intermediate, dtype=dtype) * 4
    reference = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    assert rel_err(kernels.silu_mul(gate_up), reference) < tol
