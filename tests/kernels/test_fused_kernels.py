"""The fused Triton kernels against the torch reference they replace, and the model with them switched on.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, in float32 (the interpreter mishandles
bfloat16); with CUDA the same tests run on the GPU, and the `gpu` tests add bfloat16, real sizes and a CUDA
graph capture of the fused forward.
"""
import contextlib
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before the import below

pytest.importorskip("triton")

from torch.nn import functional as F  # noqa: E402

from dendrite_nb import Engine, SamplingParams, kernels  # noqa: E402
from dendrite_nb.attention import Capabilities  # noqa: E402
from dendrite_nb.kernels.products import graph_products  # noqa: E402
from dendrite_nb.model.config import ModelConfig  # noqa: E402
from dendrite_nb.model.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dendrite_nb.model.transformer import CausalLM, RMSNorm  # noqa: E402
from dendrite_nb.testing import REAL_SHAPES, TINY_SHAPES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
FLOAT32_TOL, ROPE_FLOAT32_TOL, BF16_TOL = 1e-5, 1e-6, 1e-2  # max relative error, against the largest reference value
pytestmark = pytest.mark.usefixtures("exact_float32_matmuls")


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
    # No residual (a first layer): x is the stream, returned as it is, and the norm is rms_norm's.
    out = poisoned_like(x)
    normed, stream = kernels.add_rms_norm(x, None, weight, 1e-6, out=(out, poisoned_like(x)))
    assert stream is x and normed is out
    assert torch.equal(normed, kernels.rms_norm(x, weight, 1e-6))


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


@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_with_the_append_fused_writes_the_caches_like_append_kv_after_it(with_norm):
    from dendrite_nb.kernels.kv_append import append_kv

    tokens, heads, kv_heads, head_dim, blocks, block_size = 5, 4, 2, 32, 6, 4
    qkv = random(tokens, heads + 2 * kv_heads, head_dim)  # q, k, v as views of one projection, as the model has
    caches = [torch.full((blocks, block_size, kv_heads, head_dim), float("nan"), device=DEVICE) for _ in range(4)]
    slots = torch.tensor([3, 22, 9, 16, 5], device=DEVICE)  # scattered over blocks, out of order
    cos, sin = rope_table(head_dim, tokens)
    norm = (random(head_dim, seed=2), random(head_dim, seed=3)) if with_norm else None
    results = []
    for fused, (k_cache, v_cache) in ((False, caches[:2]), (True, caches[2:])):
        q, k, v = qkv.clone().split([heads, kv_heads, kv_heads], dim=1)
        if fused:
            kernels.rope_qk(q, k, cos, sin, out=(q, k), norm_weights=norm, append=(v, k_cache, v_cache, slots))
        else:
            kernels.rope_qk(q, k, cos, sin, out=(q, k), norm_weights=norm)
            append_kv(k, v, k_cache, v_cache, slots)
        results.append((q, k))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    for expected, got in zip(caches[:2], caches[2:]):  # the slots written hold the same bits; the rest stay NaN
        assert torch.equal(expected.nan_to_num(7.0), got.nan_to_num(7.0))
        assert not got.view(-1, kv_heads, head_dim)[slots].isnan().any()


def test_rope_with_the_append_refuses_a_bad_slot_mapping_and_writes_nothing():
    q, k, v = random(3, 2, 16).clone(), random(3, 1, 16, seed=1), random(3, 1, 16, seed=2)
    k_cache, v_cache = torch.zeros(4, 4, 1, 16, device=DEVICE), torch.zeros(4, 4, 1, 16, device=DEVICE)
    cos, sin = rope_table(16, 3)
    before = [t.clone() for t in (q, k, k_cache, v_cache)]
    with pytest.raises(ValueError, match="one slot per token"):
        kernels.rope_qk(q, k, cos, sin, out=(q, k), append=(v, k_cache, v_cache, torch.tensor([0, 1], device=DEVICE)))
    assert all(torch.equal(now, then) for now, then in zip((q, k, k_cache, v_cache), before))


def test_silu_mul_matches_silu_gate_times_up():
    width = 1500  # two column blocks, the second one partial
    gate_up = random(3, 2 * width) * 4
    out = kernels.silu_mul(gate_up, out=poisoned_like(gate_up[:, :width]))
    assert rel_err(out, F.silu(gate_up[:, :width]) * gate_up[:, width:]) < FLOAT32_TOL


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_matches_f_linear_with_ragged_edges_and_bias(rows):
    x, weight, bias = random(rows, 1000), random(300, 1000, seed=1), random(300, seed=2)  # no block divides them
    assert rel_err(kernels.gemv(x, weight), F.linear(x, weight)) < FLOAT32_TOL
    assert rel_err(kernels.gemv(x, weight, bias), F.linear(x, weight, bias)) < FLOAT32_TOL
    assert rel_err(kernels.linear(random(9, 1000), weight), F.linear(random(9, 1000), weight)) < FLOAT32_TOL
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.gemv(random(5, 1000), weight)


def reference_norm_linear_swiglu(x, residual, norm_weight, weight, bias=None):
    """The unfused path's products: (qkv-like product, SwiGLU of the gate_up-like product, the stream)."""
    stream = x if residual is None else x + residual
    normed = reference_norm(norm_weight, 1e-6)(stream)
    gate_up = F.linear(normed, weight, bias)
    half = weight.shape[0] // 2
    return gate_up, F.silu(gate_up[:, :half]) * gate_up[:, half:], stream


@pytest.mark.parametrize("rows,with_residual,with_bias", [(1, True, False), (3, False, True), (4, True, True)])
def test_gemv_with_the_norm_and_swiglu_folded_in_matches_the_separate_kernels(rows, with_residual, with_bias):
    # Widths no block divides; the norm's first pass and the product both cross several K blocks.
    x, residual = random(rows, 1000) * 3, (random(rows, 1000, seed=1) if with_residual else None)
    norm_weight, weight = 1 + 0.1 * random(1000, seed=2), random(600, 1000, seed=3)
    bias = random(600, seed=4) if with_bias else None
    expected_product, expected_swiglu, expected_stream = reference_norm_linear_swiglu(x, residual, norm_weight,
                                                                                      weight, bias)
    config = (16, 128, 4, 2)  # several programs along N and K blocks, so each program's own rstd is exercised
    product, stream = kernels.gemv(x, weight, bias, norm=(residual, norm_weight, 1e-6), config=config)
    assert rel_err(product, expected_product) < FLOAT32_TOL
    assert torch.equal(stream, expected_stream)
    swiglu, stream = kernels.gemv(x, weight, bias, norm=(residual, norm_weight, 1e-6), swiglu=True, config=config)
    assert rel_err(swiglu, expected_swiglu) < FLOAT32_TOL and torch.equal(stream, expected_stream)
    # The dispatching wrappers agree with the kernels (gemv, skinny) on decode steps, run the norm's own kernel
    # before skinny above 16 rows, and the separate kernels and cuBLAS above 64. Inside graph_products(), as a
    # captured forward runs them: on a GPU an eager step sends 2-64 rows to cuBLAS instead (below), and both
    # ways must agree with the reference.
    for in_graph in (True, False) if DEVICE == "cuda" else (True,):  # on the CPU both ways are skinny
        for count in (rows, 9, 17, 65):
            xs = random(count, 1000) * 3
            res = random(count, 1000, seed=1) if with_residual else None
            expected_product, expected_swiglu, expected_stream = reference_norm_linear_swiglu(xs, res, norm_weight,
                                                                                              weight, bias)
            with graph_products() if in_graph else contextlib.nullcontext():
                product, stream = kernels.norm_linear(xs, res, norm_weight, 1e-6, weight, bias)
                swiglu, summed = kernels.linear_silu_mul(xs, weight, bias, norm=(res, norm_weight, 1e-6))
            assert rel_err(product, expected_product) < FLOAT32_TOL and torch.equal(stream, expected_stream)
            assert rel_err(swiglu, expected_swiglu) < FLOAT32_TOL and torch.equal(summed, expected_stream)


@pytest.mark.parametrize("rows,with_residual,with_bias", [(2, True, False), (5, False, True), (16, True, True),
                                                          (40, True, False)])  # x padded to 64 rows
def test_skinny_matches_f_linear_and_the_separate_kernels_it_folds(rows, with_residual, with_bias):
    # Widths no block divides: a partial last K chunk and a partial last block of W's rows.
    x, residual = random(rows, 1000) * 3, (random(rows, 1000, seed=1) if with_residual else None)
    norm_weight, weight = 1 + 0.1 * random(1000, seed=2), random(600, 1000, seed=3)
    bias = random(600, seed=4) if with_bias else None
    config = (16, 128, 4, 2)  # several programs along N, several K chunks
    assert rel_err(kernels.skinny(x, weight, bias, config=config), F.linear(x, weight, bias)) < FLOAT32_TOL
    expected_product, expected_swiglu, expected_stream = reference_norm_linear_swiglu(x, residual, norm_weight,
                                                                                      weight, bias)
    product, stream = kernels.skinny(x, weight, bias, norm=(residual, norm_weight, 1e-6), config=config)
    assert rel_err(product, expected_product) < FLOAT32_TOL and torch.equal(stream, expected_stream)
    swiglu, stream = kernels.skinny(x, weight, bias, norm=(residual, norm_weight, 1e-6), swiglu=True,
                                    config=config)
    assert rel_err(swiglu, expected_swiglu) < FLOAT32_TOL and torch.equal(stream, expected_stream)
    # The default settings too (one program's rows of W span the whole 600 here).
    assert rel_err(kernels.skinny(x, weight, bias), F.linear(x, weight, bias)) < FLOAT32_TOL


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_skinny_split_k_matches_one_program_per_tile_and_leaves_its_counters_at_zero(splits):
    """Split-K: K's 8 chunks of 128 cut into `splits` ranges (3 ways: 3 + 3 + 2 chunks; 8: one each), the last
    program of each tile adds the partials. With the norm, its squares are split too and added before rstd."""
    skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
    x, residual = random(5, 1000) * 3, random(5, 1000, seed=1)
    norm_weight, weight, bias = 1 + 0.1 * random(1000, seed=2), random(600, 1000, seed=3), random(600, seed=4)
    config = (16, 128, 4, 2)
    expected_product, expected_swiglu, expected_stream = reference_norm_linear_swiglu(x, residual, norm_weight,
                                                                                      weight, bias)
    assert rel_err(kernels.skinny(x, weight, bias, config=config, splits=splits), F.linear(x, weight, bias)) \
        < FLOAT32_TOL
    product, stream = kernels.skinny(x, weight, bias, norm=(residual, norm_weight, 1e-6), config=config,
                                     splits=splits)
    assert rel_err(product, expected_product) < FLOAT32_TOL and torch.equal(stream, expected_stream)
    swiglu, stream = kernels.skinny(x, weight, bias, norm=(residual, norm_weight, 1e-6), swiglu=True,
                                    config=config, splits=splits)
    assert rel_err(swiglu, expected_swiglu) < FLOAT32_TOL and torch.equal(stream, expected_stream)
    # The partials add up in split order, whichever program finishes last: a second call gives the same bits.
    again, _ = kernels.skinny(x, weight, bias, norm=(residual, norm_weight, 1e-6), swiglu=True, config=config,
                              splits=splits)
    assert torch.equal(again, swiglu)
    assert int(skinny_module._TICKETS[x.device].abs().sum()) == 0  # every tile's counter set back for the next launch


def test_skinny_splits_k_only_where_the_tiles_leave_the_gpu_idle(monkeypatch):
    """default_splits on an H200's 132 multiprocessors and 228 KiB of shared memory each (no GPU needed)."""
    skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
    monkeypatch.setattr(skinny_module, "_multiprocessors", lambda device: (132, 228 * 1024))
    cuda = torch.device("cuda")

    def ways(out_features, width, norm=False, swiglu=False):
        config = skinny_module.default_config(out_features, width, norm, swiglu)
        tiles, chunks = -(-out_features // config[0]), -(-width // config[1])
        return skinny_module.default_splits(config, tiles, chunks, swiglu, cuda)

    # 0.6B: 16 to 64 tiles for 132 multiprocessors: K is cut, at least 2 chunks a split.
    assert [ways(4096, 1024, norm=True), ways(1024, 2048), ways(3072, 1024, True, True), ways(1024, 3072)] == \
        [2, 8, 6, 12]
    # 8B: deep pipelines, 1-3 programs per multiprocessor by their shared memory. q/k/v (96 tiles) and gate/up
    # (224) are not split: a split would need a second wave; o and down (64 tiles) split 2 ways, one wave.
    assert [ways(6144, 4096, norm=True), ways(4096, 4096), ways(14336, 4096, True, True), ways(4096, 14336)] == \
        [1, 2, 1, 2]
    assert ways(151936, 1024) == 1  # an LM head's thousands of tiles
    assert skinny_module.default_splits((64, 128, 4, 4), 16, 16, False, torch.device("cpu")) == 1  # interpreter


def test_skinny_refuses_bad_split_counts_and_writes_nothing():
    skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
    x, weight = random(4, 64), random(32, 64, seed=1)
    before = {device: counters.clone() for device, counters in skinny_module._TICKETS.items()}
    for splits in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="splits"):
            kernels.skinny(x, weight, splits=splits)
    assert before.keys() == skinny_module._TICKETS.keys()
    assert all(torch.equal(before[device], skinny_module._TICKETS[device]) for device in before)
    # More ways than K has chunks: one chunk each (64 columns at BLOCK_K 32: 2 ways, not 5).
    assert rel_err(kernels.skinny(x, weight, config=(16, 32, 4, 2), splits=5), F.linear(x, weight)) < FLOAT32_TOL


def test_skinny_refuses_a_bad_prefetch_count_and_writes_nothing():
    skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
    x, weight = random(4, 64), random(32, 64, seed=1)
    before = {device: counters.clone() for device, counters in skinny_module._TICKETS.items()}
    for prefetch in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="prefetch"):
            kernels.skinny(x, weight, prefetch=prefetch)
    assert before.keys() == skinny_module._TICKETS.keys()
    assert all(torch.equal(before[device], skinny_module._TICKETS[device]) for device in before)
    # 0 (none) and more chunks than a split has are both fine: the kernel prefetches what there is.
    for prefetch in (0, 9):
        assert rel_err(kernels.skinny(x, weight, config=(16, 32, 4, 2), prefetch=prefetch), F.linear(x, weight)) \
            < FLOAT32_TOL
    # The defaults: one chunk for a small (0.6B-sized) product, two for a large (8B) one.
    assert [skinny_module.default_prefetch(1024, 2048), skinny_module.default_prefetch(6144, 4096)] == [1, 2]


def test_products_go_to_gemv_skinny_or_cublas_by_rows():
    """As a captured forward dispatches them (on a GPU an eager one sends 2-64 rows to cuBLAS too: below)."""
    weight = random(64, 32)
    with graph_products():
        assert [kernels.product_kernel(random(rows, 32), weight) for rows in (1, 2, 16, 17, 64, 65)] == \
            ["gemv", "skinny", "skinny", "skinny", "skinny", "cublas"]
        assert kernels.product_kernel(random(32, 4)[:, :2].t(), random(64, 4)) == "cublas"  # columns not contiguous


@pytest.mark.gpu
def test_products_on_a_gpu_go_to_skinny_only_in_forwards_that_graphs_capture():
    """An eager step on a GPU is bound by the host's launches, and skinny's cost the host more than cuBLAS's
    (docs/lab/gpu-fast-path.md, fourteenth session): few rows go to skinny only inside graph_products(), which
    wraps a graph's capture."""
    weight = torch.randn(64, 32, device="cuda")

    def kinds():
        return [kernels.product_kernel(torch.randn(rows, 32, device="cuda"), weight) for rows in (1, 2, 64, 65)]
    assert kinds() == ["gemv", "cublas", "cublas", "cublas"]
    with graph_products():
        with graph_products():
            assert kinds() == ["gemv", "skinny", "skinny", "cublas"]
        assert kinds() == ["gemv", "skinny", "skinny", "cublas"]  # still inside the outer block
    with pytest.raises(KeyError), graph_products():
        raise KeyError("a failed capture")
    assert kinds() == ["gemv", "cublas", "cublas", "cublas"]


def test_skinny_refuses_a_row_count_it_does_not_take():
    weight = random(32, 64, seed=1)
    for rows in (1, 65):
        with pytest.raises(ValueError, match="2 <= M <= 64"):
            kernels.skinny(random(rows, 64), weight)


def test_skinny_steps_down_to_a_setting_that_fits_the_gpu(monkeypatch):
    """A GPU with less shared memory than the one the defaults were tuned on refuses them (OutOfResources at
    compile time): the call retries smaller settings and remembers the one that fitted."""
    from triton.runtime.errors import OutOfResources

    skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
    launch, tried = skinny_module._launch, []

    def small_gpu(config, *args):
        tried.append(config)
        if config[1] * config[3] > 128:  # "shared memory" = BLOCK_K x stages
            raise OutOfResources(config[1] * config[3], 128, "shared memory")
        launch(config, *args)

    monkeypatch.setattr(skinny_module, "_launch", small_gpu)
    monkeypatch.setattr(skinny_module, "_FITTED", {})
    x, weight = random(3, 100), random(40, 100, seed=1)
    assert rel_err(kernels.skinny(x, weight, config=(16, 128, 4, 3)), F.linear(x, weight)) < FLOAT32_TOL
    assert tried == [(16, 128, 4, 3), (16, 128, 4, 2), (16, 64, 4, 2)]
    tried.clear()
    kernels.skinny(x, weight, config=(16, 128, 4, 3))
    assert tried == [(16, 64, 4, 2)]  # remembered
    monkeypatch.setattr(skinny_module, "_launch", lambda config, *args: small_gpu((config[0], 999, 4, 2), *args))
    with pytest.raises(OutOfResources):  # nothing fits: the error, not a wrong result
        kernels.skinny(x, weight, config=(64, 64, 4, 2))


@pytest.mark.parametrize("product", ["gemv", "skinny"])
def test_products_refuse_a_mismatched_norm_or_swiglu_weight(product):
    product = getattr(kernels, product)
    x, weight = random(2, 64), random(32, 64, seed=1)
    with pytest.raises(ValueError, match="norm weight"):
        product(x, weight, norm=(None, random(63), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        product(x, weight, norm=(random(2, 32), random(64), 1e-6))
    with pytest.raises(ValueError, match="even number"):
        product(x, random(31, 64), swiglu=True)


def test_rope_refuses_a_table_of_another_dtype():
    q, k = random(5, 3, 16), random(5, 1, 16, seed=1)
    cos, sin = rope_table(16, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="from rope_cos_sin"):
        kernels.rope_qk(q, k, cos, sin)


# ---- the model with fused kernels on ---------------------------------------------------------------------
def tiny_engine(shape: str, dtype: str = "float32", attention: str = "auto", **options) -> Engine:
    """A random tiny model with the tiny checkpoints' weight scale (from_random's 0.02 init and unit norm weights
    make attention near uniform and norm weights invisible, so RoPE or norm bugs would barely move the logits)."""
    eng = Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), device=DEVICE, dtype=dtype,
                             num_blocks=64, block_size=4, attention=attention, **options)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in eng.model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.4 * noise)
    eng.model.use_fused_kernels(False)  # the reference, whatever the engine chose on its own
    return eng


def teacher_forced_logits(eng: Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """next_logits after the prompt and after each of `tokens` appended in turn: [len(tokens) + 1, vocab]."""
    branch = eng.new_branch("forced", prompt)
    logits = [eng.next_logits([branch])[0]]
    for token in tokens:
        eng.append(branch, [token])
        logits.append(eng.next_logits([branch])[0])
    return torch.stack(logits)


PROMPT = list(range(3, 200, 23))  # 9 tokens: the first forward is a prefill


# Qwen3: q_norm / k_norm fused into RoPE. Triton attention: RoPE and the KV append in one kernel.
@pytest.mark.parametrize("shape,attention", [("llama-gqa-untied", "auto"), ("qwen3-gqa-tied", "auto"),
                                             ("qwen3-gqa-tied", "triton")])
def test_fused_model_matches_the_reference(shape, attention):
    reference, fused = tiny_engine(shape), tiny_engine(shape, attention=attention)
    fused.model.use_fused_kernels(True)
    for eng in (reference, fused):
        eng.new_branch("trunk", PROMPT)
    assert (fused.next_logits(["trunk"]) - reference.next_logits(["trunk"])).abs().max() < 1e-4
    # Two forks decode together: each step's forward carries two sequences.
    outputs = [eng.generate(eng.fork("trunk", names=["x", "y"]), 8, GREEDY) for eng in (reference, fused)]
    assert outputs[1] == outputs[0]
    assert len(set(outputs[0][0])) > 3  # the model is not stuck repeating one token
    assert (fused.next_logits(["x", "y"]) - reference.next_logits(["x", "y"])).abs().max() < 1e-4
    # One branch alone: one-row steps, where the norms and the SwiGLU run inside the GEMVs. Two: each takes seconds
    # in the interpreter, and the second reads the KV the first one wrote.
    alone = [eng.generate([eng.fork("trunk", names=["z"])[0]], 2, GREEDY) for eng in (reference, fused)]
    assert alone[1] == alone[0]
    assert (fused.next_logits(["z"]) - reference.next_logits(["z"])).abs().max() < 1e-4
    fused.audit()


def test_fused_model_over_fp8_weights_matches_the_dequantized_reference():
    """quantize_model(model, "fp8") then the fused kernels (q/k/v and gate/up stacked with their scales, the LM
    head's scale, the norms and SwiGLU folded into the fp8 GEMV) against the reference path over the same fp8
    weights dequantized: prefill, two-row and one-row steps."""
    from dendrite_nb.model.quantized_linear import quantize_model

    reference, fused = tiny_engine("qwen3-gqa-tied"), tiny_engine("qwen3-gqa-tied")
    for eng in (reference, fused):
        quantize_model(eng.model, "fp8")
        eng.new_branch("trunk", PROMPT)
    fused.model.use_fused_kernels(True)
    assert fused.model.model.layers[0].self_attn.qkv_weight.dtype == torch.float8_e4m3fn
    assert (fused.next_logits(["trunk"]) - reference.next_logits(["trunk"])).abs().max() < 1e-4
    outputs = [eng.generate(eng.fork("trunk", names=["x", "y"]), 2, GREEDY) for eng in (reference, fused)]
    assert outputs[1] == outputs[0]
    # One one-row step (the fp8 GEMVs, a program per weight row: about 24 s in the interpreter), its token and that
    # token's log-probability, which the step's own logits give.
    alone = [eng.generate([eng.fork("trunk", names=["z"])[0]], 1, GREEDY, logprobs=True) for eng in (reference, fused)]
    assert alone[1] == alone[0]
    assert abs(fused.logprobs("z")[-1] - reference.logprobs("z")[-1]) < 1e-4
    assert (fused.next_logits(["z"]) - reference.next_logits(["z"])).abs().max() < 1e-4
    fused.audit()


def stored_bytes(model: torch.nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def test_fusing_keeps_names_and_weight_memory_and_the_reference_path():
    # No CUDA graphs: the prompt's second prefill would replay one (cuda_graphs.py), whose products over rows
    # padded to a bucket may round differently, and this test compares the reference path bit for bit.
    eng = tiny_engine("qwen3-mha-untied", cuda_graphs=False)
    model = eng.model
    keys, names, bytes_before = list(model.state_dict()), [n for n, _ in model.named_parameters()], stored_bytes(model)
    branch = eng.new_branch("a", PROMPT)
    logits_before = eng.next_logits([branch])
    model.use_fused_kernels(True)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert stored_bytes(model) == bytes_before  # the fused weights replace the separate ones, not add to them
    model.use_fused_kernels(False)  # back to the reference path, now reading views into the fused weights
    eng.prune(branch)
    assert torch.equal(eng.next_logits([eng.new_branch("b", PROMPT)]), logits_before)


def test_fused_kernels_refuse_a_device_they_cannot_use():
    config = ModelConfig.from_hf(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256))
    with torch.device("meta"):
        model = CausalLM(config)
    with pytest.raises(ValueError, match="run it on CUDA"):
        model.use_fused_kernels(True)
    assert not model.fused_kernels


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

    shapes = ((6144, hidden), (hidden, 4096), (2 * intermediate, hidden), (hidden, intermediate),
              (1024, 2048))  # the last, a 0.6B o_proj: skinny splits its K by default
    for out_features, in_features in shapes:
        weight = random(out_features, in_features, dtype=dtype, seed=5)
        for rows in (1, 4):
            x = random(rows, in_features, dtype=dtype, seed=6)
            assert rel_err(kernels.gemv(x, weight), F.linear(x, weight)) < tol
        # skinny at its defaults: split-K on the projections whose tiles alone leave multiprocessors idle
        x = random(5, in_features, dtype=dtype, seed=6)
        assert rel_err(kernels.skinny(x, weight), F.linear(x, weight)) < tol
        for splits in (1, 3):
            assert rel_err(kernels.skinny(x, weight, splits=splits), F.linear(x, weight)) < tol
    # The norm (with the residual) and the SwiGLU folded into the GEMV, at 8B sizes: hidden -> 2 x intermediate.
    weight, norm_weight = random(2 * intermediate, hidden, dtype=dtype, seed=7), random(hidden, dtype=dtype, seed=8)
    for rows in (1, 4):
        x, residual = random(rows, hidden, dtype=dtype, seed=9), random(rows, hidden, dtype=dtype, seed=10)
        expected_product, expected_swiglu, expected_stream = reference_norm_linear_swiglu(x, residual, norm_weight,
                                                                                          weight)
        product, stream = kernels.gemv(x, weight, norm=(residual, norm_weight, 1e-6))
        assert rel_err(product, expected_product) < tol and torch.equal(stream, expected_stream)
        swiglu, _ = kernels.gemv(x, weight, norm=(residual, norm_weight, 1e-6), swiglu=True)
        assert rel_err(swiglu, expected_swiglu) < tol
    # The tensor-core product of a few rows, at its default settings (float32 steps down to ones that fit).
    for rows in (5, 16, 40):
        x, residual = random(rows, hidden, dtype=dtype, seed=9), random(rows, hidden, dtype=dtype, seed=10)
        expected_product, expected_swiglu, expected_stream = reference_norm_linear_swiglu(x, residual, norm_weight,
                                                                                          weight)
        assert rel_err(kernels.skinny(x, weight), F.linear(x, weight)) < tol
        product, stream = kernels.skinny(x, weight, norm=(residual, norm_weight, 1e-6))
        assert rel_err(product, expected_product) < tol and torch.equal(stream, expected_stream)
        swiglu, _ = kernels.skinny(x, weight, norm=(residual, norm_weight, 1e-6), swiglu=True)
        assert rel_err(swiglu, expected_swiglu) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_prefetch_changes_no_bit_of_the_result(dtype):
    """The L2 prefetch before the PDL wait only asks for W's bytes early: every count, with and without split-K
    and with the folds, gives the same bits (past W's last row and column too: 1,000 x 1,000 is no multiple of
    the tiles)."""
    weight = random(1000, 1000, dtype=dtype, seed=1, device="cuda")
    x, residual = random(5, 1000, dtype=dtype, device="cuda"), random(5, 1000, dtype=dtype, seed=2, device="cuda")
    norm = (residual, random(1000, dtype=dtype, seed=3, device="cuda"), 1e-6)
    for splits in (1, 3):
        plain = [kernels.skinny(x, weight, splits=splits, prefetch=p) for p in (0, 1, 2, 5)]
        folded = [kernels.skinny(x, weight, norm=norm, swiglu=True, splits=splits, prefetch=p)[0] for p in (0, 1, 2, 5)]
        assert all(torch.equal(plain[0], other) for other in plain[1:])
        assert all(torch.equal(folded[0], other) for other in folded[1:])
    assert rel_err(plain[0], F.linear(x, weight)) < (FLOAT32_TOL if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_fused_model_matches_the_reference_on_cuda(shape):
    exact, fused = tiny_engine(shape, "float32"), tiny_engine(shape, "float32")
    fused.model.use_fused_kernels(True)
    tokens = exact.generate([exact.new_branch("a", PROMPT)], 16, GREEDY)[0]
    # Every engine reads the float32 reference's tokens, so a near tie in bf16 cannot make the sequences part.
    expected = teacher_forced_logits(exact, PROMPT, tokens)
    got = teacher_forced_logits(fused, PROMPT, tokens)
    assert rel_err(got, expected) < FLOAT32_TOL
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    # In bf16 these random tiny models amplify rounding: the reference itself ends 2-8% away from float32
    # over 17 forwards (measured on an H200). The fused path is held to the reference's own bf16 error.
    reference16, fused16 = tiny_engine(shape, "bfloat16"), tiny_engine(shape, "bfloat16")
    fused16.model.use_fused_kernels(True)
    reference_err = rel_err(teacher_forced_logits(reference16, PROMPT, tokens).float(), expected)
    fused_err = rel_err(teacher_forced_logits(fused16, PROMPT, tokens).float(), expected)
    assert fused_err < 1.5 * reference_err


class _GraphSafeAttention:
    """Stands in for an attention backend: no host syncs, so the rest of the fused forward can be captured."""

    capabilities = Capabilities()  # plain append_kv and attend: the fused model runs RoPE itself

    def append_kv(self, plan, kv, k, v):
        kv.copy_(k + v)

    def attend(self, plan, q, kv):
        return q * kv.sum()


def captured(fn):
    """(a CUDA graph of fn(), its output tensors), after one warm-up call on a side stream as capture needs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
def test_fused_forward_has_no_host_sync_and_replays_as_a_cuda_graph():
    config = REAL_SHAPES["qwen3-0.6b"].hf_config(num_hidden_layers=4)
    eng = Engine.from_random(config, device="cuda", dtype="bfloat16", num_blocks=16)
    model = eng.model
    model.use_fused_kernels(True)
    backend, layers = _GraphSafeAttention(), model.config.num_layers
    kv_layers = [torch.zeros(64, model.config.num_kv_heads, model.config.head_dim, device="cuda",
                             dtype=torch.bfloat16) for _ in range(layers)]
    input_ids = torch.randint(0, 1000, (64,), device="cuda")
    positions = torch.arange(100, 164, device="cuda")
    with graph_products():  # the products a captured step runs (skinny at 64 rows), eager ones as well
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(input_ids, positions, kv_layers, backend, None)  # compiles the kernels; raises on a host sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph, hidden = captured(lambda: model(input_ids, positions, kv_layers, backend, None))
        input_ids.copy_(torch.randint(0, 1000, (64,), device="cuda"))
        positions.add_(5000)
        graph.replay()
        assert torch.equal(hidden, model(input_ids, positions, kv_layers, backend, None))


@pytest.mark.gpu
def test_split_k_products_in_captured_steps_match_the_reference_engine():
    """0.6B-wide layers (hidden 1024): skinny cuts K of every projection of a 5-leaf step (default_splits), and
    the steps replay as CUDA graphs. Float32 greedy tokens equal the torch reference's, logits within 1e-4."""
    skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
    config = REAL_SHAPES["qwen3-0.6b"].hf_config(num_hidden_layers=2, vocab_size=512)
    engines = [Engine.from_random(config, device="cuda", dtype="float32", num_blocks=256, block_size=16,
                                  attention=attention, cuda_graphs=graphs)
               for attention, graphs in (("torch", False), ("triton", True))]
    engines[0].model.use_fused_kernels(False)
    engines[1].model.use_fused_kernels(True)
    results = []
    for eng in engines:
        trunk = eng.new_branch("trunk", list(range(1, 40)))
        kids = eng.fork(trunk, 5)
        results.append((eng.generate(kids, 16, GREEDY), eng.next_logits(kids)))
    assert results[0][0] == results[1][0]
    assert rel_err(results[1][1], results[0][1]) < FLOAT32_TOL
    assert engines[1]._graphs.captures >= 1
    assert int(skinny_module._TICKETS[torch.device("cuda", 0)].abs().sum()) == 0


@pytest.mark.gpu
def test_kernels_launched_early_still_read_what_the_kernel_before_them_wrote(monkeypatch):
    """Under PDL (kernels/pdl.py) each kernel starts before the one before it ends, loads its weights, and then
    waits for that kernel's writes. A chain where every kernel reads the last one's output, replayed from a
    CUDA graph, must equal the same chain launched without PDL, bit for bit."""
    from dendrite_nb.kernels import pdl

    if not pdl.uses_pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs a GPU of compute capability 9 or later")
    torch.manual_seed(0)
    width, out = 1024, 4096
    layers = [(torch.randn(out, width, device="cuda", dtype=torch.bfloat16) * 0.02,
               torch.randn(width, out // 2, device="cuda", dtype=torch.bfloat16) * 0.02,
               1 + 0.1 * torch.randn(width, device="cuda", dtype=torch.bfloat16)) for _ in range(8)]
    x0 = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
    x5 = torch.randn(5, width, device="cuda", dtype=torch.bfloat16)

    def chain():
        x, residual = x0, None
        for gate_up, down, norm_weight in layers:
            hidden, residual = kernels.gemv(x, gate_up, norm=(residual, norm_weight, 1e-6), swiglu=True)
            x = kernels.rms_norm(kernels.gemv(hidden, down), norm_weight, 1e-6)
        y, stream = x5, None  # the same for the few-row product
        for gate_up, down, norm_weight in layers:
            hidden, stream = kernels.skinny(y, gate_up, norm=(stream, norm_weight, 1e-6), swiglu=True)
            y = kernels.skinny(hidden, down)
        return x, residual, y, stream

    def without_pdl():
        with monkeypatch.context() as patch:
            patch.setattr(pdl, "uses_pdl", lambda tensor: False)  # every kernel asks pdl_arguments, which asks this
            return chain()

    eager = chain()
    assert all(torch.equal(a, b) for a, b in zip(eager, without_pdl()))
    graph, replayed = captured(chain)
    for _ in range(3):  # new inputs each time: a kernel that read before its wait would see the last replay's
        x0.copy_(torch.randn_like(x0))
        x5.copy_(torch.randn_like(x5))
        graph.replay()
        expected = without_pdl()
        assert all(torch.equal(a, b) for a, b in zip(replayed, expected))
