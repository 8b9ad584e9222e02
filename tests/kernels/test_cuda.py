"""The reference path on CUDA: transformers parity in float32, fork consistency, and a bf16 run. Marked gpu."""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams

from tests.support.engines import ALL_SHAPES, decode_recording_logits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32_matmuls")]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)
PROMPT = "A tree of thought, with branches"


@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_cuda_float32_matches_transformers_on_cpu(shape, checkpoint, hf_model):
    eng = Engine.from_pretrained(checkpoint(shape), device="cuda", num_blocks=128, block_size=16, debug=True)
    branch = eng.new_branch("a", PROMPT)
    start = len(branch)
    step_logits = decode_recording_logits(eng, branch, 64, GREEDY)
    with torch.no_grad():
        reference = hf_model(shape)(torch.tensor([branch.tokens])).logits[0, start - 1: start + 63]
    # CUDA float32 GEMMs sum in another order than the CPU reference; over 64 steps that reaches ~1e-4 on
    # logits of magnitude 5, so the device bar is 1e-3 with greedy tokens exact (1e-4 is the CPU contract).
    assert (step_logits - reference).abs().max() < 1e-3
    assert branch.tokens[start:] == reference.argmax(-1).tolist()
    eng.audit()


def test_cuda_fork_matches_linear_runs(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=256, block_size=8, debug=True)
    trunk = eng.new_branch("trunk", PROMPT)
    eng.generate([trunk], 3, GREEDY)
    kids = eng.fork(trunk, 8)
    batched = eng.generate(kids, 16, SAMPLED)
    for i, kid in enumerate(kids):
        alone = eng.new_branch(f"alone{i}", PROMPT, seed=kid.seed)
        eng.generate([alone], 3, GREEDY)
        assert eng.generate([alone], 16, SAMPLED)[0] == batched[i]
        assert (eng.next_logits([alone]) - eng.next_logits([kid])).abs().max() < 1e-4
    eng.audit()


def test_cuda_bfloat16_runs_close_to_float32(checkpoint):
    full = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=64)
    half = Engine.from_pretrained(checkpoint(), device="cuda", dtype="bfloat16", num_blocks=64)
    a, b = full.new_branch("a", PROMPT), half.new_branch("a", PROMPT)
    logits32, logits16 = full.next_logits([a])[0], half.next_logits([b])[0]
    assert torch.isfinite(logits16).all()
    assert torch.nn.functional.cosine_similarity(logits32, logits16, dim=0) > 0.99
    assert len(half.generate([b], 8, SAMPLED)[0]) == 8
    half.audit()


def test_cuda_constrained_outputs_parse_with_masks_applied_on_the_device(checkpoint):
    """The constraint masks are filled on the CPU and applied to logits on the GPU (bf16 here)."""
    import json

    import jsonschema

    from tests.support.json_schemas import SCHEMAS

    eng = Engine.from_pretrained(checkpoint(), device="cuda", dtype="bfloat16", num_blocks=8192, block_size=16)
    names = []
    for index, schema in enumerate(SCHEMAS):
        eng.new_branch(f"s{index}", "Answer in JSON:")
        eng.constrain(f"s{index}", {"json_schema": schema})
        names.append(f"s{index}")
    outputs = eng.generate(names, 1800, SamplingParams(temperature=1.0, seed=3))
    for name, schema, tokens in zip(names, SCHEMAS, outputs):
        assert eng.branch(name).matcher.is_stopped(), name
        jsonschema.validate(json.loads(eng.tokenizer.decode(tokens, skip_special_tokens=True)), schema)
    kids = eng.fork(eng.new_branch("ask", "Which way?"), 8)
    for tokens in eng.generate(kids, 50, SamplingParams(temperature=1.0), constraint={"choices": ["left", "right"]}):
        assert eng.tokenizer.decode(tokens, skip_special_tokens=True) in ("left", "right")


def test_cuda_logprobs_match_transformers_on_cpu(checkpoint, hf_model):
    """The sampled tokens' log-probabilities ride back with the tokens (one copy, the forward keeps running),
    also under the race sampler (temperature only) and a CUDA-graph decode step."""
    eng = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=128, block_size=16)
    kids = eng.fork(eng.new_branch("root", PROMPT), 4)
    eng.generate(kids, 12, SamplingParams(temperature=0.8, ignore_eos=True), logprobs=True)
    eng.generate(kids, 4, SAMPLED, logprobs=True)
    for kid in kids:
        tokens, kept = kid.tokens, eng.logprobs(kid)
        with torch.no_grad():
            reference = torch.log_softmax(hf_model("llama-gqa-untied")(torch.tensor([tokens])).logits[0], -1)
        scored = [(p, lp) for p, lp in enumerate(kept) if lp is not None]
        assert len(scored) == 16
        assert max(abs(lp - reference[p - 1, tokens[p]].item()) for p, lp in scored) < 1e-3  # the device bar above


def test_cuda_appended_text_is_scored_like_transformers(checkpoint, hf_model):
    """Scoring appended text reads every position's hidden state: a short append replays a CUDA graph,
    a long one runs in prefill chunks; both against transformers on the CPU."""
    eng = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=128, block_size=16, prefill_chunk_tokens=32)
    question = eng.new_branch("q", PROMPT)
    short, long = eng.fork(question, 2)
    eng.append(short, " Swim.", logprobs=True)
    eng.append(long, " Build a raft from logs and rope, then paddle over to the far bank. " * 4, logprobs=True)
    for answer in (short, long):
        tokens, kept = answer.tokens, eng.logprobs(answer)
        with torch.no_grad():
            reference = torch.log_softmax(hf_model("llama-gqa-untied")(torch.tensor([tokens])).logits[0], -1)
        assert all(lp is not None for lp in kept[len(question):]) and all(lp is None for lp in kept[:len(question)])
        assert max(abs(kept[p] - reference[p - 1, tokens[p]].item()) for p in range(len(question), len(tokens))) < 1e-3
