"""The torch-tree backend (tree-aware decode in plain torch, the fast path off CUDA) against the flat reference."""
import random

import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.attention import BatchLayout, TorchAttention, make_backend
from dendrite_nb.attention.torch_tree_backend import TorchTreeAttention, TreeDecodePlan
from dendrite_nb.kv.cascade import decode_layout
from dendrite_nb.testing import TINY_SHAPES

from tests.support.random_trees import random_tree

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied", "llama-mha-tied"])
@pytest.mark.parametrize("min_shared", [1, 64])
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_tree_decode_matches_the_flat_reference(device, shape, min_shared, kv_dtype):
    eng = Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), device=device, num_blocks=1024,
                             block_size=4, kv_dtype=kv_dtype, attention="torch")
    leaves = random_tree(eng, random.Random(3), leaves=10, depth=3)  # nested shared nodes, mid-block forks
    kv = eng.pool.layers()[1]
    q = torch.randn(len(leaves), eng.config.num_heads, eng.config.head_dim, device=device)
    layout = decode_layout(eng.branch_tree, leaves, min_shared_tokens=min_shared)
    shared = [seg for seg in layout.segments if len(seg.rows) > 1]
    assert shared, "the root prompt (64-120 tokens) is shared"
    if min_shared == 1:
        assert any(len(seg.rows) < len(leaves) for seg in shared), "the tree should share nodes at several depths"
    reference = TorchAttention()
    expected = reference.attend(reference.plan(layout, 4, eng.device), q, kv)
    tree = TorchTreeAttention()
    plan = tree.plan(layout, 4, eng.device)
    assert isinstance(plan, TreeDecodePlan) and len(plan.shared) == len(shared)
    got = tree.attend(plan, q, kv)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_steps_without_segments_and_prefill_match_the_reference_through_sdpa(kv_dtype):
    eng = Engine.from_random(TINY_SHAPES["qwen3-gqa-tied"].hf_config(vocab_size=256), num_blocks=256, block_size=4,
                             attention="torch", kv_dtype=kv_dtype)
    leaves = random_tree(eng, random.Random(5), leaves=4, depth=2)
    kv = eng.pool.layers()[0]
    tree, reference = TorchTreeAttention(), TorchAttention()
    flat = decode_layout(eng.branch_tree, leaves, shared=False)
    prefill = BatchLayout(q_lens=[3, 1], kv_lens=[9, 5], block_tables=[[0, 1, 2], [3, 4]])
    for layout, tokens in ((flat, len(leaves)), (prefill, 4)):
        q = torch.randn(tokens, eng.config.num_heads, eng.config.head_dim)
        plan = tree.plan(layout, 4, eng.device)
        assert not isinstance(plan, TreeDecodePlan)
        expected = reference.attend(reference.plan(layout, 4, eng.device), q, kv)
        assert (tree.attend(plan, q, kv) - expected).abs().max() < 1e-5


def test_auto_off_cuda_is_torch_tree_and_the_reference_stays_flat():
    assert make_backend("auto", "cpu").name == "torch-tree" and make_backend("auto", "cpu").capabilities.tree_segments
    assert make_backend("torch", "cpu").name == "torch" and not make_backend("torch", "cpu").capabilities.tree_segments
    with pytest.raises(ValueError, match="torch-tree"):  # the error lists it among the choices
        make_backend("torch_tree", "cpu")
    for name in ("torch", "torch-tree"):   # both keep short prefill chunks (their classes say why)
        eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=16,
                                 attention=name)
        assert eng.prefill_chunk_tokens == 512


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_torch_tree_engine_decodes_a_tree_like_the_flat_reference(shape):
    """A prompt long enough to be shared (>= 64 tokens), forked twice: greedy tokens equal and logits within
    1e-5 at every step, so the shared reads really ran (checked through the segments' plan)."""
    engines = [Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), num_blocks=512, block_size=4,
                                  attention=name, debug=True) for name in ("torch", "torch-tree")]
    leaves_per_engine = []
    for eng in engines:
        root = eng.new_branch("root", [(7 * i) % 251 for i in range(90)])
        kids = eng.fork(root, 3)
        eng.generate(kids, 70, GREEDY)  # each kid's own node passes 64 tokens: nested sharing below
        grandkids = eng.fork(kids[0], 2) + eng.fork(kids[1], 2) + [kids[2]]
        leaves_per_engine.append(grandkids)
    for step in range(6):
        tokens = [eng.generate(leaves, 1, GREEDY) for eng, leaves in zip(engines, leaves_per_engine)]
        assert tokens[0] == tokens[1], f"step {step}"
        logits = [eng.next_logits(leaves) for eng, leaves in zip(engines, leaves_per_engine)]
        assert (logits[0] - logits[1]).abs().max() < 1e-5, f"step {step}"
    layout = decode_layout(engines[1].branch_tree, leaves_per_engine[1])  # what the last steps read
    assert sorted(len(seg.rows) for seg in layout.segments if len(seg.rows) > 1) == [2, 2, 5]
    for eng in engines:
        eng.audit()


def test_a_row_without_a_position_of_its_own_is_refused():
    """A layout where a row reads only shared positions would softmax over nothing; the plan says why instead."""
    from dendrite_nb.attention.base import KVSegment
    layout = BatchLayout(q_lens=[1, 1], kv_lens=[8, 9], block_tables=[[0, 1], [0, 2, 3]],
                         segments=[KVSegment((0, 1), 0, 8, (0, 1)), KVSegment((1,), 8, 9, (3,))])
    with pytest.raises(ValueError, match=r"reads no position of its own \(rows \[0\]\)"):
        TorchTreeAttention().plan(layout, 4, torch.device("cpu"))
