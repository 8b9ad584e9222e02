"""Instructions appended to many forks of one document (fork, then append_many) on the CPU's torch-tree backend,
which reads the shared document once per forward: the same logits and tokens as each branch prefilled alone."""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.attention import torch_tree_backend
from dendrite_nb.testing import TINY_SHAPES

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
TOLERANCE = 1e-4


@pytest.fixture
def tree_prefills(monkeypatch):
    """Counts the torch-tree backend's tree-aware prefill attention calls (one per layer of such a forward)."""
    calls = []
    attend = torch_tree_backend.attend_tree_prefill
    monkeypatch.setattr(torch_tree_backend, "attend_tree_prefill", lambda *args: calls.append(1) or attend(*args))
    return calls


def linear_logits(eng: Engine, sequences: list[list[int]]) -> torch.Tensor:
    """Each sequence prefilled alone on a fresh branch of `eng`, one after another: [len(sequences), vocab]."""
    branches = [eng.new_branch(f"linear{i}", tokens) for i, tokens in enumerate(sequences)]
    return eng.next_logits(branches)


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_fork_then_append_many_matches_a_linear_run(shape, tree_prefills):
    """Forks at two depths, instructions of 1..23 tokens, prefill chunks of 16 tokens (so some instructions span
    two forwards): the leaves' logits within 1e-4 of each full sequence prefilled alone on the flat reference,
    and the same greedy tokens after."""
    config = TINY_SHAPES[shape].hf_config(vocab_size=256)
    tree = Engine.from_random(config, num_blocks=512, block_size=4, attention="torch-tree", prefill_chunk_tokens=16,
                              debug=True)
    flat = Engine.from_random(config, num_blocks=512, block_size=4, attention="torch")
    doc = tree.new_branch("doc", [(7 * i) % 251 for i in range(90)])
    kids = tree.fork(doc, 4)
    tree.append_many((kid, [(3 * i + j) % 250 for i in range(1 + 5 * j)]) for j, kid in enumerate(kids))
    grandkids = tree.fork(kids[3], 3)   # kids[3] holds 16 tokens past the document: a second shared depth
    tree.append_many((kid, [(11 * i + j) % 250 for i in range(2 + 7 * j)]) for j, kid in enumerate(grandkids))
    assert len(tree_prefills) > 0, "the tree-aware prefill ran"
    leaves = kids[:3] + grandkids
    expected = linear_logits(flat, [leaf.tokens for leaf in leaves])
    assert (tree.next_logits(leaves) - expected).abs().max() < TOLERANCE
    assert tree.generate(leaves, 4, GREEDY) == flat.generate([flat.branch_tree.resolve(f"linear{i}")
                                                               for i in range(len(leaves))], 4, GREEDY)
    tree.audit()


def test_the_demo_model_forks_of_a_document_match_the_reference_and_each_branch_alone(demo_engine, tree_prefills):
    """SmolLM2-135M (float32): 4 forks of a 120-token document given their questions in one append_many (one
    tree-aware forward), against the same calls on the flat reference backend and against each whole sequence
    prefilled alone (no prefix reuse, so a flat forward each): logits within 1e-4, the same greedy tokens."""
    questions = ["\nQuestion: who wrote it?\nAnswer:", "\nSummarise it.", "\nQ: what place?\nA:", "\nTitle:"]
    leaves = {}
    for name in ("torch-tree", "torch"):
        eng = demo_engine(num_blocks=96, attention=name)
        document = eng.encode("The river bends twice before the old mill. " * 12, at_start=True)[:120]
        kids = eng.fork(eng.new_branch("doc", document), len(questions))
        eng.append_many(zip(kids, questions))
        leaves[name] = eng, kids
    eng, kids = leaves["torch-tree"]
    assert len(tree_prefills) == eng.config.num_layers, "one tree-aware prefill forward"
    eng.prefix_reuse = False
    alone = [eng.new_branch(f"alone{i}", kid.tokens) for i, kid in enumerate(kids)]
    assert len(tree_prefills) == eng.config.num_layers, "a branch prefilled alone reads flat"
    ref, ref_kids = leaves["torch"]
    logits = eng.next_logits(kids)
    assert (logits - ref.next_logits(ref_kids)).abs().max() < TOLERANCE
    assert (logits - eng.next_logits(alone)).abs().max() < TOLERANCE
    tokens = eng.generate(kids, 2, GREEDY)
    assert tokens == ref.generate(ref_kids, 2, GREEDY) == eng.generate(alone, 2, GREEDY)
