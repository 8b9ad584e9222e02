"""The Triton backend's tree-aware prefill (several sequences' new tokens under shared tree nodes: a shared node is
one KV run for every token under it, read once per tile of them) against the flat reference, under the CPU
interpreter here and on a GPU where there is one."""
import random

import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.attention import BatchLayout, TorchAttention
from dendrite_nb.testing import TINY_SHAPES

from tests.support.random_trees import appended_tree, prefill_layout

pytest.importorskip("triton")
from dendrite_nb.attention.triton_backend import TritonAttention  # noqa: E402  (needs triton)

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the interpreter runs only where CUDA is absent
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
BLOCK = 4


def kv_reads(backend: TritonAttention, layout: BatchLayout, device) -> int:
    """Positions the plan's items read, summed over items (each item reads its run for all its rows at once)."""
    host = backend.host_plan(layout, BLOCK, torch.device(device))
    return sum(int((items[:, 3] - items[:, 2]).sum()) for items in host.items.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"] if torch.cuda.is_available()
                         else ["qwen3-gqa-tied"])   # the interpreter takes ~16 s a shape; the engine test runs llama
def test_tree_prefill_matches_the_flat_reference_and_reads_less(device, shape):
    eng = Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), device=device, num_blocks=1024,
                             block_size=BLOCK, attention="torch")
    branches, lengths, _ = appended_tree(eng, random.Random(5))
    layout = prefill_layout(eng, branches, lengths, min_shared=1)
    flat = BatchLayout(layout.q_lens, layout.kv_lens, layout.block_tables)
    kv = eng.pool.layers()[1]
    q = torch.randn(sum(lengths), eng.config.num_heads, eng.config.head_dim, device=device)
    reference = TorchAttention()
    expected = reference.attend(reference.plan(flat, BLOCK, eng.device), q, kv)
    backend = TritonAttention()
    backend.configure(eng.config.num_heads, eng.config.num_kv_heads)
    got = backend.attend(backend.plan(layout, BLOCK, eng.device), q, kv)
    assert (got - expected).abs().max() < 1e-5
    assert kv_reads(backend, layout, device) < kv_reads(backend, flat, device), "shared nodes read fewer times"


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_whose_segments_share_nothing_is_planned_flat(device):
    eng = Engine.from_random(TINY_SHAPES["qwen3-gqa-tied"].hf_config(vocab_size=256), device=device,
                             num_blocks=256, block_size=BLOCK, attention="torch")
    a, b = eng.new_branch("a", list(range(30))), eng.new_branch("b", list(range(100, 140)))
    eng.append_many([(a, [1, 2, 3]), (b, [4, 5])])
    layout = prefill_layout(eng, [a, b], [3, 2], min_shared=1)
    assert all(len(seg.rows) == 1 for seg in layout.segments)
    backend = TritonAttention()
    backend.configure(eng.config.num_heads, eng.config.num_kv_heads)
    assert backend._runs(layout) == backend._runs(BatchLayout(layout.q_lens, layout.kv_lens, layout.block_tables))


def test_fork_then_append_many_on_triton_matches_the_torch_engine(checkpoint):
    """Forks of a document given instructions of different lengths in one append_many (a tree-aware prefill on
    the Triton engine), then greedy steps: the same logits within 1e-4 and tokens as the flat torch engine."""
    results = []
    for name in ("torch", "triton"):
        eng = Engine.from_pretrained(checkpoint(), device=DEVICES[0], attention=name, num_blocks=256,
                                     block_size=BLOCK, debug=True)
        doc = eng.new_branch("doc", [(7 * i) % 251 for i in range(37)])
        kids = eng.fork(doc, 3)
        eng.append_many((kid, [(3 * i + j) % 250 for i in range(2 + 3 * j)]) for j, kid in enumerate(kids))
        results.append((eng.next_logits(kids), eng.generate(kids, 3, GREEDY)))
        eng.audit()
    assert (results[0][0] - results[1][0]).abs().max() < 1e-4
    assert results[0][1] == results[1][1]
