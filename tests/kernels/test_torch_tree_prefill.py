"""The torch-tree backend's tree-aware prefill (several sequences' new tokens under shared tree nodes, each shared
node read once for all of them) against the flat reference, and the reads it saves."""
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dendrite_nb import Engine
from dendrite_nb.attention import BatchLayout, TorchAttention
from dendrite_nb.attention.torch_backend import TorchPlan
from dendrite_nb.attention.torch_tree_backend import TorchTreeAttention
from dendrite_nb.attention.torch_partials import attend_part, attend_part_written_out
from dendrite_nb.attention.torch_tree_prefill import TreePrefillPlan
from dendrite_nb.testing import TINY_SHAPES

from tests.support.random_trees import appended_tree, prefill_layout

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCK = 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied", "llama-mha-tied"])
@pytest.mark.parametrize("min_shared", [1, 64])
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_tree_prefill_matches_the_flat_reference_on_random_trees(device, shape, min_shared, kv_dtype):
    for seed in (3, 4):
        eng = Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), device=device, num_blocks=1024,
                                 block_size=BLOCK, kv_dtype=kv_dtype, attention="torch")
        branches, lengths, solo = appended_tree(eng, random.Random(seed))
        layout = prefill_layout(eng, branches, lengths, min_shared)
        shared = [seg for seg in layout.segments if len(seg.rows) > 1]
        assert shared and all(solo not in seg.rows for seg in shared)
        if min_shared == 1:
            assert len({seg.rows for seg in shared}) >= 3, "nodes are shared at several depths"
        kv = eng.pool.layers()[1]
        q = torch.randn(sum(lengths), eng.config.num_heads, eng.config.head_dim, device=device)
        reference = TorchAttention()
        expected = reference.attend(reference.plan(layout, BLOCK, eng.device), q, kv)
        tree = TorchTreeAttention()
        plan = tree.plan(layout, BLOCK, eng.device)
        assert isinstance(plan, TreePrefillPlan) and len(plan.shared) == len(shared)
        assert any(not isinstance(read.tokens, slice) for read in plan.shared), "rows 0..n-1 and a subset"
        got = tree.attend(plan, q, kv)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert (got - expected).abs().max() < 1e-5, f"seed {seed}"


def test_a_prefill_without_shared_nodes_and_a_single_branch_read_flat_and_match():
    eng = Engine.from_random(TINY_SHAPES["qwen3-gqa-tied"].hf_config(vocab_size=256), num_blocks=256,
                             block_size=BLOCK, attention="torch")
    a, b = eng.new_branch("a", list(range(70))), eng.new_branch("b", list(range(100, 180)))
    eng.append_many([(a, [1, 2, 3]), (b, [4, 5])])
    kid = eng.fork(b, 1)[0]
    eng.append(kid, [6, 7, 8, 9])
    tree, reference = TorchTreeAttention(), TorchAttention()
    for branches, lengths in (([a, b], [3, 2]), ([kid], [4])):
        layout = prefill_layout(eng, branches, lengths, min_shared=1)
        plan = tree.plan(layout, BLOCK, eng.device)
        assert isinstance(plan, TorchPlan), "nothing shared: each sequence read flat"
        q = torch.randn(sum(lengths), eng.config.num_heads, eng.config.head_dim)
        kv = eng.pool.layers()[0]
        expected = reference.attend(reference.plan(layout, BLOCK, eng.device), q, kv)
        assert (tree.attend(plan, q, kv) - expected).abs().max() < 1e-5


def test_a_shared_segment_over_a_rows_new_tokens_is_refused():
    """New tokens are each sequence's own (its leaf's); a layout that shares them is a bug, said so."""
    from dendrite_nb.attention.base import KVSegment
    layout = BatchLayout(q_lens=[2, 1], kv_lens=[8, 9], block_tables=[[0, 1], [0, 2, 3]],
                         segments=[KVSegment((0, 1), 0, 8, (0, 1)), KVSegment((1,), 8, 9, (3,))])
    with pytest.raises(ValueError, match=r"reaches the new tokens of rows \[0\] \(from \[6\]\)"):
        TorchTreeAttention().plan(layout, BLOCK, torch.device("cpu"))


class PoolReads(TorchFunctionMode):
    """Counts the cache positions gathered from one layer's K cache (by any indexing of it or of a view of it)."""

    def __init__(self, cache: torch.Tensor):
        super().__init__()
        self.address, self.row = cache.data_ptr(), cache.shape[2] * cache.shape[3]  # KV heads x head_dim
        self.positions = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select) and \
                isinstance(args[0], torch.Tensor) and args[0].data_ptr() == self.address:
            self.positions += result.numel() // self.row
        return result


@pytest.mark.parametrize("attention", ["torch-tree", "torch"])
def test_the_shared_document_is_gathered_once_per_layer_not_once_per_branch(attention):
    """append_many of 6 instructions to forks of one 300-token document: the tree-aware prefill gathers each
    layer's document positions once (plus each fork's own, padded); the flat reference gathers them 6 times,
    which the same spy sees (so it does see the reads)."""
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=512,
                             block_size=BLOCK, attention=attention)
    doc = eng.new_branch("doc", [(7 * i) % 251 for i in range(300)])
    kids = eng.fork(doc, 6)
    instructions = [[(5 * i + j) % 250 for i in range(3 + j)] for j in range(6)]   # 3..8 tokens
    reads = PoolReads(eng.pool.layers()[0].k)
    with reads:
        eng.append_many(zip(kids, instructions))
    if attention == "torch-tree":
        assert reads.positions == 300 + 6 * 8   # the document once, each fork's own positions padded to 8
    else:
        assert reads.positions == 6 * (300 + 8)   # each fork's whole context, padded to the longest


@pytest.mark.parametrize("masked", [False, True])
def test_partial_attention_returns_the_same_output_and_lse_written_out_or_fused(masked):
    """attend_part (torch's CPU flash kernel) and attend_part_written_out (what a GPU runs) agree, and the lse
    is the log-sum-exp of the scaled, biased scores."""
    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (torch.randn(2, 3, shape, 16, generator=generator) for shape in (12, 20, 20))
    bias = None
    if masked:   # causal-like: row m sees positions up to 8 + m, and every row sees at least one
        bias = torch.zeros(2, 1, 12, 20).masked_fill_(torch.arange(20) > 8 + torch.arange(12)[:, None], float("-inf"))
    fused = attend_part(queries, keys, values, 0.25, bias)
    written = attend_part_written_out(queries, keys, values, 0.25, bias)
    scores = queries @ keys.transpose(-1, -2) * 0.25 + (0 if bias is None else bias)
    for out, lse in (fused, written):
        assert out.shape == (2, 3, 12, 16) and lse.shape == (2, 3, 12)
        assert (out - torch.softmax(scores, -1) @ values).abs().max() < 1e-5
        assert (lse - torch.logsumexp(scores, -1)).abs().max() < 1e-5
