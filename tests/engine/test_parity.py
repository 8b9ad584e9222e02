"""Golden tokens: the engine matches transformers (float32, CPU) within 1e-4 along prompt, appends and 64 greedy steps."""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams

from tests.support.engines import ALL_SHAPES, decode_recording_logits

TOLERANCE = 1e-4
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [T, vocab]


@pytest.mark.parametrize("shape", ALL_SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_and_greedy_tokens_match_transformers(shape, block_size, checkpoint, hf_model):
    hf = hf_model(shape)
    eng = Engine.from_pretrained(checkpoint(shape), num_blocks=128, block_size=block_size, prefill_chunk_tokens=7)
    branch = eng.new_branch("a", "Rivers carve their valleys slowly, one grain at a time.")
    prompt = branch.tokens
    expected = hf_logits(hf, prompt)[-1]
    assert (eng.next_logits([branch])[0] - expected).abs().max() < TOLERANCE

    eng.append(branch, " Then the tree of thought forks")
    eng.append(branch, " into three.")
    expected = hf_logits(hf, branch.tokens)[-1]
    assert (eng.next_logits([branch])[0] - expected).abs().max() < TOLERANCE

    start = len(branch)
    step_logits = decode_recording_logits(eng, branch, 64, GREEDY)
    tokens = branch.tokens
    reference = hf_logits(hf, tokens)[start - 1: start - 1 + 64]  # teacher-forced logits before each new token
    assert (step_logits - reference).abs().max() < TOLERANCE
    assert tokens[start:] == reference.argmax(-1).tolist()  # greedy tokens identical
    assert len(set(tokens[start:])) > 3  # the random model is not stuck on one token


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_batched_generate_matches_transformers_greedy(shape, checkpoint, hf_model):
    hf = hf_model(shape)
    eng = Engine.from_pretrained(checkpoint(shape), num_blocks=128, block_size=4)
    prompts = ["A", "Two roads diverged in a wood,", "{\"name\": \"Ada\","]
    branches = [eng.new_branch(f"p{i}", p) for i, p in enumerate(prompts)]
    starts = [len(b) for b in branches]
    outs = eng.generate(branches, 24, GREEDY)
    for branch, start, out in zip(branches, starts, outs):
        assert branch.tokens[start:] == out and len(out) == 24
        logits = hf_logits(hf, branch.tokens)
        assert out == logits[start - 1: -1].argmax(-1).tolist()


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_forked_leaves_under_a_shared_prompt_match_transformers(shape, checkpoint, hf_model):
    """The CPU path's tree decode (torch-tree reads the shared prompt once for all leaves; few-row products as
    W @ x.T) against transformers running each leaf's whole sequence alone: logits within 1e-4, same tokens."""
    hf = hf_model(shape)
    eng = Engine.from_pretrained(checkpoint(shape), num_blocks=256, block_size=4)
    assert eng.backend.name == "torch-tree"
    root = eng.new_branch("root", [(11 * i) % 200 + 3 for i in range(80)])  # >= 64 tokens: read shared
    leaves = eng.fork(root, 4)
    for i, leaf in enumerate(leaves):
        eng.append(leaf, [i + 5])
    start = len(leaves[0])
    step_logits = [decode_recording_logits(eng, leaf, 1, GREEDY) for leaf in leaves]  # one leaf's own step each
    outs = eng.generate(leaves, 16, GREEDY)  # then all four together, the prompt read once a step
    batch_logits = eng.next_logits(leaves)
    for leaf, first, out, last in zip(leaves, step_logits, outs, batch_logits):
        reference = hf_logits(hf, leaf.tokens)
        assert (first[0] - reference[start - 1]).abs().max() < TOLERANCE
        assert out == reference[start: -1].argmax(-1).tolist()
        assert (last - hf_logits(hf, leaf.tokens)[-1]).abs().max() < TOLERANCE
