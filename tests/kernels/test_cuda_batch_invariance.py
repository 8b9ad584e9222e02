"""Where a branch's tokens do not depend on the rest of its batch on CUDA, and where they can. Marked gpu.

- float32: the same tokens however the branches are batched (all together, max_batch=4, one call each).
- bfloat16: a given batch is deterministic (the same branches batched the same way give the same tokens, run
  after run, graphs on or off), but another batch size may round differently (a single row takes the GEMV
  kernels; cuBLAS picks its tiling by the batch size), so logits agree only to bf16 rounding and tokens may
  part after a near-tie. docs/reference.md (Sampling) states exactly this.
- Two threads generating on one engine with CUDA graphs get the tokens of two calls in a row.
"""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.testing import REAL_SHAPES

from tests.support.engines import results_of_threads

pytestmark = pytest.mark.gpu
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
PROMPT = list(range(1000, 1300))   # token ids: random weights have no tokenizer
LEAVES, STEPS = 8, 24


@pytest.fixture(scope="module")
def model_bf16():
    engine = Engine.from_random(REAL_SHAPES["qwen3-0.6b"].hf_config(), device="cuda", dtype="bfloat16",
                                num_blocks=64)
    return engine.model


def leaves(model, **options) -> tuple[Engine, list]:
    """LEAVES forks of a 300-token trunk, each given 1, 3, 5, ... tokens of its own (contexts of several lengths)."""
    engine = Engine(model, None, device="cuda", num_blocks=512, block_size=16, **options)
    engine.new_branch("trunk", PROMPT)
    kids = engine.fork("trunk", LEAVES)
    engine.append_many([(kid, list(range(2000 + 17 * i, 2001 + 17 * i + 2 * i))) for i, kid in enumerate(kids)])
    return engine, kids


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_bfloat16_decoding_is_deterministic_for_a_fixed_batch(model_bf16, cuda_graphs):
    runs = []
    for _ in range(2):
        engine, kids = leaves(model_bf16, cuda_graphs=cuda_graphs)
        runs.append(engine.generate(kids, STEPS, SAMPLED))
    assert runs[0] == runs[1]


def test_bfloat16_logits_across_batch_shapes_agree_to_bfloat16_rounding(model_bf16):
    """One greedy step together, 4 per step, or one at a time, then the logits that step's forward gives. They
    agree to bf16 rounding, not exactly: on an H100, 4 per step matched 8 together bit for bit, while one at a
    time (the single-row GEMV kernels) differed by up to 0.045, enough to part greedy tokens after a near-tie."""
    after_one_step = []
    for max_batch in (None, 4, 1):
        engine, kids = leaves(model_bf16)
        engine.generate(kids, 1, GREEDY, max_batch=max_batch)
        after_one_step.append(engine.next_logits(kids).float())
    together, *others = after_one_step
    for other in others:
        assert (together - other).abs().max() < 0.25   # a bf16 logit near 10 is spaced 0.0625 from the next


def test_float32_tokens_do_not_depend_on_the_batch(checkpoint):
    outputs = []
    for max_batch in (None, 4, 1):
        engine = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=256, block_size=8)
        trunk = engine.new_branch("trunk", "A tree of thought, with branches")
        kids = engine.fork(trunk, LEAVES)
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            outputs.append(engine.generate(kids, STEPS, SAMPLED, max_batch=max_batch))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    assert outputs[0] == outputs[1] == outputs[2]


def test_two_threads_generating_with_cuda_graphs_get_the_tokens_of_two_calls_in_a_row(model_bf16):
    sequential, _ = leaves(model_bf16)
    concurrent, _ = leaves(model_bf16)
    names = [f"trunk/{i}" for i in range(LEAVES)]
    halves = [names[: LEAVES // 2], names[LEAVES // 2:]]
    expected = [sequential.generate(half, STEPS, SAMPLED) for half in halves]
    calls = [lambda half=half: concurrent.generate(half, STEPS, SAMPLED) for half in halves]
    assert results_of_threads(calls) == expected
    concurrent.audit()
