"""The sharding math of tensor parallelism, in one process: a model split over two ranks, each rank's forward run on
its own thread with an all-reduce that sums over the threads, gives the whole model's hidden states and KV. And the
degrees a model takes, checked before anything starts."""
import copy
import threading

import pytest
import torch

from dendrite_nb.attention import BatchLayout, make_backend
from dendrite_nb.distributed.shard import check_degree, degrees_for, local_heads, shard_model, weights_checksum
from dendrite_nb.errors import TensorParallelError
from dendrite_nb.kv import KVPool
from dendrite_nb.model.config import ModelConfig
from dendrite_nb.model.loader import random_model
from dendrite_nb.testing import TINY_SHAPES

WORLD = 2
BLOCK = 4


class ThreadSum:
    """An all-reduce among threads: every rank's tensor becomes the sum of all ranks' (in rank order)."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * world

    def hook(self, rank: int):
        def all_reduce(tensor: torch.Tensor, buffer: int = 0) -> None:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()   # every rank has read the parts before any writes the next ones
            tensor.copy_(total)
        return all_reduce


def forward(model, kv_heads: int, layout: BatchLayout, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, hidden], the pool's KV) of one forward from an empty pool."""
    config = model.config
    pool = KVPool(num_layers=config.num_layers, num_kv_heads=kv_heads, head_dim=config.head_dim, num_blocks=8,
                  block_size=BLOCK, dtype=torch.float32, device=torch.device("cpu"))
    backend = make_backend("torch")
    plan = backend.plan(layout, BLOCK, torch.device("cpu"))
    hidden = model(ids, torch.tensor(layout.positions), pool.layers(), backend, plan)
    return hidden, pool.kv


@pytest.mark.parametrize("shape", ["llama-biased", "qwen3-gqa-tied", "llama-mha-tied"])
def test_two_shards_sum_to_the_whole_model(shape):
    """Biases on all four attention products and the MLP (added once, on rank 0), Qwen3's q/k norms, tied and untied
    heads, GQA and MHA: the ranks' hidden states after the all-reduces equal the whole model's, and each rank's KV is
    the whole model's KV of its own heads."""
    config = ModelConfig.from_hf(TINY_SHAPES[shape].hf_config(vocab_size=96))
    whole = random_model(config, torch.device("cpu"), torch.float32, seed=3)
    # Two sequences, a prefill of 5 tokens and one of 3, in blocks of 4.
    layout = BatchLayout(q_lens=[5, 3], kv_lens=[5, 3], block_tables=[[0, 1], [2]])
    ids = torch.tensor([5, 17, 33, 2, 90, 41, 7, 64])
    want_hidden, want_kv = forward(whole, config.num_kv_heads, layout, ids)

    total = ThreadSum(WORLD)
    shards = [copy.deepcopy(whole) for _ in range(WORLD)]
    for rank, shard in enumerate(shards):
        shard_model(shard, rank, WORLD, total.hook(rank))
    results: list = [None] * WORLD
    kv_heads = local_heads(config, WORLD)[1]

    def run(rank):
        results[rank] = forward(shards[rank], kv_heads, layout, ids)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for rank, (hidden, kv) in enumerate(results):
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        heads = slice(rank * kv_heads, (rank + 1) * kv_heads)
        torch.testing.assert_close(kv, want_kv[..., heads, :], rtol=1e-5, atol=1e-5)


def test_a_shard_holds_its_part_of_each_weight():
    config = ModelConfig.from_hf(TINY_SHAPES["llama-biased"].hf_config(vocab_size=96))
    whole = random_model(config, torch.device("cpu"), torch.float32, seed=1)
    shard = copy.deepcopy(whole)
    shard_model(shard, 1, WORLD, lambda tensor: None)
    layer, full = shard.model.layers[0], whole.model.layers[0]
    head_dim = config.head_dim
    q_rows = slice(2 * head_dim, 4 * head_dim)   # heads 2 and 3 of 4
    torch.testing.assert_close(layer.self_attn.q_proj.weight, full.self_attn.q_proj.weight[q_rows])
    torch.testing.assert_close(layer.self_attn.k_proj.weight, full.self_attn.k_proj.weight[head_dim:])  # KV head 1
    torch.testing.assert_close(layer.self_attn.o_proj.weight, full.self_attn.o_proj.weight[:, q_rows])
    torch.testing.assert_close(layer.mlp.down_proj.weight, full.mlp.down_proj.weight[:, 64:])
    assert layer.self_attn.o_proj.bias is None and layer.mlp.down_proj.bias is None  # rank 0 adds them once
    assert layer.self_attn.shape == (2, 1, head_dim)
    assert shard.lm_head is None   # rank 0 alone computes logits


def test_the_checksum_tells_weights_apart():
    config = ModelConfig.from_hf(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=96))
    cpu = torch.device("cpu")
    same = [weights_checksum(random_model(config, cpu, torch.float32, seed=0)) for _ in range(2)]
    assert same[0] == same[1]
    assert weights_checksum(random_model(config, cpu, torch.float32, seed=1)) != same[0]


def test_the_degrees_a_model_takes():
    gqa = ModelConfig.from_hf(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=96))   # 4 heads, 2 KV heads
    assert degrees_for(gqa) == [1, 2]
    assert check_degree(2, gqa) == 2
    with pytest.raises(TensorParallelError, match=r"tensor_parallel=4 cannot split .* KV heads \(2\).* runs at "
                                                  r"tensor_parallel 1, 2\."):
        check_degree(4, gqa)
    three = ModelConfig.from_hf(TINY_SHAPES["qwen3-mha-untied"].hf_config(vocab_size=96))   # 3 heads
    with pytest.raises(TensorParallelError, match=r"runs at tensor_parallel 1, 3\."):
        check_degree(2, three)
    for bad in (0, -2, True, 2.0, "2", None):
        with pytest.raises(TensorParallelError, match="must be an int >= 1"):
            check_degree(bad)


@pytest.mark.parametrize("shape", ["llama-biased", "qwen3-gqa-tied", "llama-gqa-untied"])
def test_a_shard_drawn_alone_equals_the_whole_models_shard(shape):
    """random_shard (what a rank of Engine.from_random builds, never holding the whole model) gives each rank the
    very weights that cutting loader.random_model's whole model gives it, and the whole model's checksum."""
    from dendrite_nb.distributed.random_shard import random_shard
    from dendrite_nb.persist import model_fingerprint
    from dendrite_nb.distributed.shard import shard_weights

    config = ModelConfig.from_hf(TINY_SHAPES[shape].hf_config(vocab_size=96))
    cpu = torch.device("cpu")
    whole = random_model(config, cpu, torch.float32, seed=5)
    for rank in range(WORLD):
        cut = copy.deepcopy(whole)
        shard_weights(cut, rank, WORLD)
        drawn, checksum, whole_fingerprint = random_shard(config, cpu, torch.float32, 5, rank, WORLD)
        assert checksum == weights_checksum(whole) and whole_fingerprint == model_fingerprint(whole)
        want, got = dict(cut.named_parameters()), dict(drawn.named_parameters())
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert (drawn.lm_head is None) == (cut.lm_head is None)
        if config.tie_word_embeddings:
            assert drawn.lm_head.weight is drawn.model.embed_tokens.weight


def _fused_rank(rank: int, port: int, shape: str, attention: str, results) -> None:
    """One rank of test_fused_shards_over_gloo_equal_the_whole_fused_model (a spawned process, or the test's own)."""
    import torch.distributed as dist

    from dendrite_nb.distributed.channels import COLLECTIVE_TIMEOUT, HOST, Channels
    from dendrite_nb.distributed.shard import connect, shard_weights

    store = dist.TCPStore(HOST, port, WORLD, rank == 0, COLLECTIVE_TIMEOUT)
    channels = Channels(store, rank, WORLD, torch.device("cpu"))
    try:
        config = ModelConfig.from_hf(TINY_SHAPES[shape].hf_config(vocab_size=96))
        model = random_model(config, torch.device("cpu"), torch.float32, seed=3)
        shard_weights(model, rank, WORLD)
        connect(model, rank, WORLD, channels.all_reduce)
        model.use_fused_kernels(True)
        hidden, kv = fused_forward(model, attention, local_heads(config, WORLD))
        results.put((rank, hidden.numpy(), kv.numpy()))   # by value: torch's queue would pass a file descriptor
    finally:
        channels.shutdown()


def fused_forward(model, attention: str, heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, hidden], the pool's KV) of the fused path's forward of two sequences from an empty pool."""
    config, cpu = model.config, torch.device("cpu")
    pool = KVPool(num_layers=config.num_layers, num_kv_heads=heads[1], head_dim=config.head_dim, num_blocks=8,
                  block_size=BLOCK, dtype=torch.float32, device=cpu)
    backend = make_backend(attention, cpu, torch.float32, config.head_dim, torch.float32)
    if backend.capabilities.needs_head_layout:
        backend.configure(*heads, torch.float32)
    layout = BatchLayout(q_lens=[5, 3], kv_lens=[5, 3], block_tables=[[0, 1], [2]])
    plan = backend.plan(layout, BLOCK, cpu)
    ids = torch.tensor([5, 17, 33, 2, 90, 41, 7, 64])
    hidden = model(ids, torch.tensor(layout.positions), pool.layers(), backend, plan)
    return hidden, pool.kv.clone()


@pytest.mark.parametrize("shape, attention", [("llama-biased", "torch"), ("qwen3-gqa-tied", "triton")])
def test_fused_shards_over_gloo_equal_the_whole_fused_model(shape, attention):
    """The fused Triton path a GPU rank runs (interpreted here), with its all-reduce after o_proj and down_proj, in
    two processes over gloo: each rank's hidden states equal the whole fused model's, and its KV the whole model's
    KV of its heads. (Threads cannot run it: the Triton interpreter's state is global.)"""
    import multiprocessing
    import socket

    from dendrite_nb.kernels import INTERPRETED

    if not INTERPRETED:
        pytest.skip("the fused kernels run on the CPU only under TRITON_INTERPRET=1")
    config = ModelConfig.from_hf(TINY_SHAPES[shape].hf_config(vocab_size=96))
    whole = random_model(config, torch.device("cpu"), torch.float32, seed=3)
    whole.use_fused_kernels(True)
    want_hidden, want_kv = fused_forward(whole, attention, (config.num_heads, config.num_kv_heads))
    with socket.socket() as probe:   # a free port for the store (rank 0, in this process, opens it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=_fused_rank, args=(1, port, shape, attention, results), daemon=True)
    worker.start()
    try:
        _fused_rank(0, port, shape, attention, results)
        got = {rank: (torch.from_numpy(hidden), torch.from_numpy(kv))
               for rank, hidden, kv in (results.get(timeout=120) for _ in range(WORLD))}
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
    kv_heads = local_heads(config, WORLD)[1]
    for rank, (hidden, kv) in got.items():
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        heads = slice(rank * kv_heads, (rank + 1) * kv_heads)
        torch.testing.assert_close(kv, want_kv[..., heads, :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, form", [("llama-biased", "sharded safetensors"), ("phi3-gqa-untied", "safetensors"),
                                         ("qwen3-gqa-tied", "gguf q8_0")])
def test_a_checkpoint_shard_read_a_tensor_at_a_time_equals_the_whole_models_shard(tmp_path, shape, form):
    """ModelSpec.build_shard of a checkpoint (what each rank of Engine.from_pretrained builds, reading one tensor
    at a time and never holding the whole model) gives each rank the weights that cutting the whole loaded model
    gives it, and the whole model's checksum and fingerprint: HF weights split over shard files, Phi-3's q/k/v and
    gate/up fused on disk, a tied head, a quantized GGUF."""
    from dendrite_nb.distributed.shard import shard_weights
    from dendrite_nb.distributed.spec import ModelSpec
    from dendrite_nb.engine.build import load_checkpoint
    from dendrite_nb.persist import model_fingerprint
    from dendrite_nb.testing import write_tiny_checkpoint
    from dendrite_nb.testing.gguf_writer import write_gguf

    folder = write_tiny_checkpoint(tmp_path / "hf", shape, seed=4,
                                   max_shard_bytes=20_000 if form.startswith("sharded") else None)
    path = write_gguf(folder, tmp_path / "tiny.gguf", "Q8_0") if form.startswith("gguf") else folder
    cpu = torch.device("cpu")
    whole, _, _ = load_checkpoint(path, cpu, torch.float32)
    spec = ModelSpec(str(path), None, 0, torch.float32)
    for rank in range(WORLD):
        cut = copy.deepcopy(whole)
        shard_weights(cut, rank, WORLD)
        built, tokenizer, origin, checksum, whole_fingerprint = spec.build_shard(rank, WORLD, cpu,
                                                                               tokenizer=rank == 0)
        assert checksum == weights_checksum(whole) and whole_fingerprint == model_fingerprint(whole)
        assert (tokenizer is not None) == (rank == 0)
        want, got = dict(cut.named_parameters()), dict(built.named_parameters())
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        if whole.config.tie_word_embeddings:
            assert built.lm_head.weight is built.model.embed_tokens.weight
