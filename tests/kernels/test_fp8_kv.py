"""FP8 KV cache: e4m3 values with a float32 scale per token and KV head, against a float32 KV cache;
and the Triton kernel that appends K/V to the paged cache, against the torch backend's writes.

Without CUDA the kernel runs in Triton's interpreter, whose float32 -> e4m3 conversion is wrong whenever
rounding carries into the exponent (126.4 becomes 64, not 128) and below e4m3's normal range: there the fp8
kernel test feeds values that need no rounding; the `gpu` tests check arbitrary values, bf16 inputs and a
CUDA graph capture.
"""
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before it is imported

import dendrite_nb.engine.build as engine_module  # noqa: E402
from dendrite_nb import Engine, SamplingParams  # noqa: E402
from dendrite_nb.attention import BatchLayout, TorchAttention  # noqa: E402
from dendrite_nb.kv import KVPool  # noqa: E402
from dendrite_nb.kv.fp8 import FP8_MAX, dequantize, quantize  # noqa: E402
from dendrite_nb.testing import TINY_SHAPES  # noqa: E402

CONFIG = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
PROMPT = [int(t) for t in torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(1))]  # mid-block


def fp8_engine(**options):
    return Engine.from_random(CONFIG, device="cpu", kv_dtype="fp8", num_blocks=64, block_size=4, **options)


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


# ---- quantisation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip_error_is_bounded_per_vector(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4, 64, generator=generator) * torch.logspace(-3, 3, 4096)[:, None, None]
    x[:, 0] **= 3  # heavy tails: most elements far below the vector's largest
    x = x.to(dtype)
    values, scales = quantize(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    error = dequantize(values, scales) - x.float()
    amax = x.float().abs().amax(-1)
    # Every element within half an e4m3 step at the top of the range (16 of 448); a float32 ulp of slack.
    assert (error.abs().amax(-1) <= amax / 28 * (1 + 1e-6)).all()
    per_vector = error.norm(dim=-1) / x.float().norm(dim=-1)  # 3 mantissa bits: at most 2^-4 per element
    assert per_vector.max() < 2 ** -4 and 0.01 < per_vector.mean() < 0.04
    assert values.float().abs().amax(-1).eq(FP8_MAX).all()  # the full e4m3 range is used


def test_zero_vectors_quantize_to_zero_without_nan():
    values, scales = quantize(torch.zeros(3, 2, 8))
    assert (scales > 0).all() and torch.equal(dequantize(values, scales), torch.zeros(3, 2, 8))


# ---- the pool ----------------------------------------------------------------------------------------

def test_fp8_pool_holds_scales_per_token_and_head_and_counts_their_bytes():
    eng = fp8_engine()
    cfg = eng.config
    pool = eng.pool
    assert pool.kv.dtype == torch.float8_e4m3fn
    assert pool.scales.dtype == torch.float32
    assert pool.num_blocks == 64 and pool.kv.shape[:3] == (cfg.num_layers, 2, 65)  # + the sink block
    assert pool.scales.shape == (cfg.num_layers, 2, 65, 4, cfg.num_kv_heads)
    assert pool.bytes_per_block == cfg.num_layers * 2 * 4 * cfg.num_kv_heads * (cfg.head_dim + 4)
    layer = pool.layers()[1]
    layer.v_scale[3, 2, 1] = 5.0  # the per-layer scales are views into the pool
    assert pool.scales[1, 1, 3, 2, 1] == 5.0

    plain = Engine.from_random(CONFIG, device="cpu", num_blocks=8, block_size=4)
    assert plain.pool.scales is None and all(kv.k_scale is None and kv.v_scale is None for kv in plain.pool.layers())


@pytest.mark.parametrize("kv_dtype", ["fp8", "float8_e4m3fn", torch.float8_e4m3fn])
def test_every_fp8_spelling_sizes_the_default_pool_with_the_scale_bytes(kv_dtype, monkeypatch):
    monkeypatch.setattr(engine_module, "CPU_KV_BUDGET_BYTES", 1 << 16)  # small enough to bind on the tiny model
    eng = Engine.from_random(CONFIG, device="cpu", kv_dtype=kv_dtype, block_size=4)
    assert eng.kv_dtype == torch.float8_e4m3fn
    assert "cpu float32 (KV float8_e4m3fn)," in repr(eng)   # the repr says where the KV differs
    assert eng.pool.num_blocks == (1 << 16) // eng.pool.bytes_per_block
    assert eng.pool.num_blocks * eng.pool.bytes_per_block > (1 << 16) - eng.pool.bytes_per_block


@pytest.mark.parametrize("integrated, fraction", [(False, engine_module.CUDA_KV_FRACTION),
                                                  (True, engine_module.CUDA_INTEGRATED_KV_FRACTION)])
def test_a_gpu_sharing_the_hosts_memory_gets_a_smaller_default_pool(integrated, fraction, monkeypatch):
    """On a DGX Spark the GPU's free memory is the host's too: the default pool leaves half of it."""
    free_bytes = 10 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 2 * free_bytes))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(is_integrated=integrated))
    config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)
    config.max_position_embeddings = 4096
    blocks = engine_module.default_num_blocks(config, torch.bfloat16, torch.device("cuda"), 16)
    per_block = KVPool.block_bytes(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.bfloat16)
    assert blocks == int(free_bytes * fraction) // per_block
    assert engine_module.CUDA_INTEGRATED_KV_FRACTION < engine_module.CUDA_KV_FRACTION


@pytest.mark.parametrize("options, message", [
    ({"kv_dtype": "fp4"}, r"kv_dtype 'fp4' is not supported; choose one of \['bfloat16', 'float16', 'float32', "
                          r"'float8_e4m3fn', 'fp8'\]"),
    ({"kv_dtype": torch.float8_e5m2}, r"kv_dtype torch.float8_e5m2 is not supported; choose one of"),
    ({"dtype": "fp8"}, r"dtype 'fp8' is not supported; choose one of \['bfloat16', 'float16', 'float32'\]"),
])
def test_unsupported_dtypes_are_refused_with_the_choices(options, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_random(CONFIG, device="cpu", num_blocks=8, block_size=4, **options)


# ---- the engine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("capability, runs", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((12, 1), True)])
def test_triton_takes_an_fp8_cache_only_on_gpus_with_e4m3(capability, runs, monkeypatch):
    """Triton's fp8e4nv does not compile below compute capability 8.9 (A100, RTX 30xx): the backend says so
    before any kernel is built, and `auto` picks another one that can keep an fp8 cache."""
    pytest.importorskip("triton")
    from dendrite_nb.attention import make_backend, unavailable_reason

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    reason = unavailable_reason("triton", cuda, torch.bfloat16, 128, torch.float8_e4m3fn)
    assert (reason is None) == runs
    if not runs:
        assert "8.9" in reason and ".".join(map(str, capability)) in reason
        assert make_backend("auto", cuda, torch.bfloat16, 128, torch.float8_e4m3fn).name != "triton"
    assert unavailable_reason("triton", cuda, torch.bfloat16, 128, torch.bfloat16) is None  # bf16 KV: any GPU


def test_fp8_logits_track_a_float32_kv_cache_after_a_prompt_and_16_greedy_steps():
    reference = Engine.from_random(CONFIG, device="cpu", num_blocks=64, block_size=4)
    eng = fp8_engine()
    want, got = reference.new_branch("a", PROMPT), eng.new_branch("a", PROMPT)
    checks = [(reference.next_logits([want])[0], eng.next_logits([got])[0])]
    reference.generate([want], 16, GREEDY)
    eng.generate([got], 16, GREEDY)
    assert got.tokens == want.tokens
    checks.append((reference.next_logits([want])[0], eng.next_logits([got])[0]))
    for expected, actual in checks:
        # Measured ~1e-2 relative error and cosine 0.99995 on this model.
        assert 1e-4 < relative_error(actual, expected) < 5e-2  # above 1e-4: the cache really is quantised
        assert torch.nn.functional.cosine_similarity(actual, expected, dim=0) > 0.999


def test_fp8_forks_mid_block_decode_exactly_like_linear_runs():
    eng = fp8_engine(debug=True)
    trunk = eng.new_branch("trunk", PROMPT)
    assert len(trunk) % eng.pool.block_size != 0, "the fork point must be mid-block to exercise copy-on-write"
    kids = eng.fork(trunk, 2)
    kid_logits = {kid.name: [] for kid in kids}
    for _ in range(6):  # one at a time: each kid's first write copies the shared tail block (values and scales)
        for kid in kids:
            eng.generate([kid], 1, GREEDY)
            kid_logits[kid.name].append(eng.next_logits([kid])[0])
    linear = eng.new_branch("linear", PROMPT)
    for step in range(6):
        eng.generate([linear], 1, GREEDY)
        expected = eng.next_logits([linear])[0]
        for kid in kids:
            assert torch.equal(kid_logits[kid.name][step], expected), (kid.name, step)
    assert all(kid.tokens == linear.tokens for kid in kids)
    eng.audit()


def test_fp8_canaries_pass_a_session_and_catch_a_write_into_a_freed_block():
    eng = fp8_engine(debug=True)
    trunk = eng.new_branch("trunk", PROMPT)
    kids = eng.fork(trunk, 3)
    eng.generate(kids, 9, GREEDY)
    eng.prune(kids[1:])
    eng.generate([kids[0]], 5, GREEDY)
    eng.audit()

    free = eng.pool.allocator.free_blocks()[0]
    eng.pool.scales[1, 0, free, 2, 0] = 0.5  # only a scale: values stay poisoned, the canary still sees it
    with pytest.raises(AssertionError, match="KV canary broken"):
        eng.audit()
    eng.pool.scales[1, 0, free, 2, 0] = -416.0
    eng.audit()
    eng.pool.kv[0, 1, free, 0, 1, 3] = 1.0
    with pytest.raises(AssertionError, match="KV canary broken"):
        eng.audit()


def test_dendrite_load_passes_kv_dtype_fp8_to_the_engine(checkpoint):
    from IPython import get_ipython
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import start_ipython
    from dendrite_nb.magics import current_engine, current_session

    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "dendrite_nb")
    with pytest.raises(UsageError, match="kv_dtype 'fp4' is not supported; choose one of"):
        ip.run_line_magic("dendrite", f"load {checkpoint()} --kv-dtype fp4 --replace")
    ip.run_line_magic("dendrite", f"load {checkpoint()} --kv-dtype fp8 --num-blocks 16 --block-size 4 --replace")
    session = current_session()
    try:
        eng = current_engine()
        assert eng.kv_dtype == eng.pool.kv.dtype == torch.float8_e4m3fn and eng.pool.scales is not None
        eng.generate([eng.new_branch("root", "Hello there")], 3, GREEDY)
        eng.audit()
    finally:
        session.close_views()
        session.engine.close()
        session.engine = None


# ---- the Triton append kernel ------------------------------------------------------------------------

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter
# Three sequences of 3, 1 and 5 new tokens, written into blocks out of order: 9 tokens, 5 blocks of 4.
LAYOUT = BatchLayout(q_lens=[3, 1, 5], kv_lens=[7, 4, 5], block_tables=[[5, 2], [0], [7, 3]])


@pytest.fixture(scope="module")
def append_kv():
    pytest.importorskip("triton")
    from dendrite_nb.kernels.kv_append import append_kv

    return append_kv


def two_pools(dtype, device=KERNEL_DEVICE, head_dim=24):
    """Identical canaried pools: one written by the torch backend, one by the kernel. head_dim 24 is no power of 2."""
    return [KVPool(num_layers=2, num_kv_heads=2, head_dim=head_dim, num_blocks=8, block_size=4, dtype=dtype,
                   device=torch.device(device), canaries=True) for _ in range(2)]


def strided_kv(tokens, dtype=torch.float32, device=KERNEL_DEVICE, head_dim=24, seed=0):
    """k, v [T, 2, head_dim], neither contiguous and with different strides: k a column slice of a fused
    projection (as the model makes it), v head-major."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 8 * head_dim, generator=generator).to(device, dtype)
    v = torch.randn(2, tokens, head_dim, generator=generator).to(device, dtype).transpose(0, 1)
    return qkv[:, 4 * head_dim: 6 * head_dim].view(tokens, 2, head_dim), v


def write_both(append_kv, pools, k, v, slot_mapping, layer=1):
    """The torch backend's append into pools[0], the kernel's into pools[1]; same layer, same slots."""
    TorchAttention().append_kv(SimpleNamespace(slot_mapping=slot_mapping), pools[0].layers()[layer], k, v)
    append_kv(k, v, *pools[1].layers()[layer][:2], slot_mapping, *pools[1].layers()[layer][2:])


def assert_same_pools(reference, got):
    assert torch.equal(got.kv.view(torch.uint8), reference.kv.view(torch.uint8))  # bitwise, canaries included
    assert (got.scales is None and reference.scales is None) or torch.equal(got.scales, reference.scales)


def test_kernel_writes_float32_caches_like_the_torch_backend(append_kv):
    pools = two_pools(torch.float32)
    plan = TorchAttention().plan(LAYOUT, 4, torch.device(KERNEL_DEVICE))
    k, v = strided_kv(len(plan.slot_mapping))
    assert not k.is_contiguous() and not v.is_contiguous() and k.stride() != v.stride()
    write_both(append_kv, pools, k, v, plan.slot_mapping)
    assert_same_pools(*pools)
    assert not pools[1]._untouched([5, 2, 0, 7, 3])  # it wrote something


def representable_kv(tokens, device=KERNEL_DEVICE, head_dim=24):
    """k, v whose quantisation needs no rounding: e4m3 normals with one +-448 per vector, times a power of two
    (so the scale is that power of two and x / scale is exact). Vector (0, 0) is all zeros (the scale floor)."""
    generator = torch.Generator().manual_seed(2)
    magnitude = torch.exp2(torch.empty(2, tokens, 2, head_dim).uniform_(-6, 8.8, generator=generator))
    sign = torch.randint(0, 2, magnitude.shape, generator=generator) * 2 - 1
    values = (sign * magnitude).to(torch.float8_e4m3fn).float()
    top = torch.randint(0, head_dim, (2, tokens, 2, 1), generator=generator)
    values.scatter_(-1, top, FP8_MAX * sign.float().gather(-1, top))
    values[:, 0, 0] = 0.0
    scales = torch.exp2(torch.randint(-12, 6, (2, tokens, 2, 1), generator=generator).float())
    k, v = (values * scales).to(device)
    return k, v


def test_kernel_quantises_to_fp8_exactly_like_the_torch_backend(append_kv):
    pools = two_pools(torch.float8_e4m3fn)
    plan = TorchAttention().plan(LAYOUT, 4, torch.device(KERNEL_DEVICE))
    k, v = representable_kv(len(plan.slot_mapping))
    write_both(append_kv, pools, k, v, plan.slot_mapping)
    assert_same_pools(*pools)
    written = pools[1].scales[1, :, plan.slot_mapping // 4, plan.slot_mapping % 4]  # [2, T, KVH]
    assert (written > 0).all() and written.min() == torch.finfo(torch.float32).tiny  # the zero vector's floor


def test_kernel_refuses_an_fp8_cache_without_scales(append_kv):
    pool = two_pools(torch.float8_e4m3fn)[0]
    k, v = strided_kv(2)
    layer = pool.layers()[0]
    with pytest.raises(ValueError, match="k_scale and v_scale are required for a float8_e4m3fn cache"):
        append_kv(k, v, layer.k, layer.v, torch.tensor([0, 1], device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match=r"k has \(2, 16\) \(kv_heads, head_dim\) per token but the cache holds"):
        append_kv(k[..., :16], v[..., :16], *layer[:2], torch.tensor([0, 1], device=KERNEL_DEVICE), *layer[2:])
    assert pool._untouched(list(range(8)))


@pytest.mark.gpu
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_kernel_matches_the_torch_backend_bitwise_on_cuda(append_kv, input_dtype, cache_dtype):
    pools = two_pools(cache_dtype, "cuda", head_dim=128)
    plan = TorchAttention().plan(LAYOUT, 4, torch.device("cuda"))
    k, v = strided_kv(len(plan.slot_mapping), input_dtype, "cuda", head_dim=128)
    k[0] *= 1e-3  # small vectors, and values down in e4m3's subnormal range
    write_both(append_kv, pools, k, v, plan.slot_mapping)
    assert_same_pools(*pools)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph():
    """Captured once with static buffers; replays write new K/V at new slots, as a decode step's graph does
    (its padding rows write to the pool's sink block)."""
    from dendrite_nb.kernels.kv_append import append_kv

    pools = two_pools(torch.float8_e4m3fn, "cuda", head_dim=128)
    k, v = (torch.zeros(3, 2, 128, device="cuda") for _ in range(2))
    slots = torch.zeros(3, dtype=torch.long, device="cuda")
    layer = pools[1].layers()[1]
    append_kv(k, v, *layer[:2], slots, *layer[2:])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_kv(k, v, *layer[:2], slots, *layer[2:])
    pools[1].kv.fill_(-416.0)
    pools[1].scales.fill_(-416.0)
    for step, new_slots in enumerate(([1, 12, 30], [2, 13, pools[1].sink_slot])):
        new_k, new_v = strided_kv(3, torch.float32, "cuda", head_dim=128, seed=step)
        k.copy_(new_k), v.copy_(new_v), slots.copy_(torch.tensor(new_slots))
        graph.replay()
        TorchAttention().append_kv(SimpleNamespace(slot_mapping=slots.clone()), pools[0].layers()[1], new_k, new_v)
    torch.cuda.synchronize()
    assert_same_pools(*pools)


@pytest.mark.gpu
def test_fp8_engine_on_cuda_stores_the_same_kv_through_the_triton_backend():
    """The triton backend appends with the kernel (inside its decode CUDA graphs), the torch one with kv/fp8.py."""
    engines = [Engine.from_random(CONFIG, device="cuda", kv_dtype="fp8", num_blocks=64, block_size=4, attention=name)
               for name in ("torch", "triton")]
    branches = [eng.new_branch("a", PROMPT) for eng in engines]
    for eng, branch in zip(engines, branches):
        eng.generate([branch], 16, GREEDY)
    assert branches[0].tokens == branches[1].tokens
    reference, triton_engine = (eng.pool for eng in engines)
    # Layer 0's K/V come from the embeddings alone, so its cache must match to the byte.
    assert torch.equal(triton_engine.kv[0].view(torch.uint8), reference.kv[0].view(torch.uint8))
    assert torch.equal(triton_engine.scales[0], reference.scales[0])
    logits = [eng.next_logits([branch])[0] for eng, branch in zip(engines, branches)]
    assert relative_error(logits[1], logits[0]) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copy_blocks_equals_one_copy_block_per_pair(dtype):
    """The batched copy-on-write copy (one gather, one scatter) moves the same bytes, scales included, as a
    copy_block per pair, with a source repeated (forks sharing one tail block)."""
    pools = [KVPool(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8, block_size=4, dtype=dtype,
                    device=torch.device("cpu")) for _ in range(2)]
    generator = torch.Generator().manual_seed(3)
    for pool in pools:
        pool.kv.view(torch.uint8).copy_(torch.randint(0, 120, pool.kv.view(torch.uint8).shape, generator=generator,
                                                      dtype=torch.uint8))
        if pool.scales is not None:
            pool.scales.copy_(torch.rand(pool.scales.shape, generator=generator))
        generator.manual_seed(3)
    pairs = [(1, 4), (1, 6), (2, 0)]
    for source, target in pairs:
        pools[0].copy_block(source, target)
    pools[1].copy_blocks(torch.tensor([s for s, _ in pairs]), torch.tensor([t for _, t in pairs]))
    assert_same_pools(*pools)
    assert torch.equal(pools[1].kv[:, :, 6].view(torch.uint8), pools[1].kv[:, :, 1].view(torch.uint8))
