"""An engine split over two CPU processes (gloo) against the same engine in one process: the same tokens, logits
within 1e-4, forks, batches of branches, copy-on-write, rewinds and preemption; and the requests it refuses before
starting anything. One two-process engine of each kind serves the module (a spawned process takes seconds to
start)."""
import multiprocessing
import os
import signal

import pytest
import torch

from dendrite_nb import Engine, GenerationInterrupted, SamplingParams
from dendrite_nb.errors import TensorParallelError
from dendrite_nb.testing import TINY_SHAPES
from tests.distributed.conftest import engine_pair, fork_and_linear_tokens
from tests.support.engines import engine_state

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=50)
SHAPE = "llama-gqa-untied"   # 4 heads and 2 KV heads: two ranks of 2 and 1
CONFIG = TINY_SHAPES[SHAPE].hf_config(vocab_size=256)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]   # 19 tokens: a partial block
# The CPU's quantized products compute in bf16 (model/quantized_linear.py): two ranks' partial sums round where
# one process rounds the whole sum once.
QUANTIZED_ATOL = 1e-2


@pytest.fixture(scope="module")
def pair():
    """(one process, two processes): engines of the same random model."""
    yield from engine_pair(CONFIG)


def both(engines, call):
    """call(engine) on each engine; the two results."""
    return [call(engine) for engine in engines]


def test_greedy_tokens_and_logits_match_one_process(engines):
    one, two = engines
    assert (one.tensor_parallel, two.tensor_parallel) == (1, 2)
    assert two.kv_bytes == one.kv_bytes   # each rank holds half the KV heads of the same blocks
    both(engines, lambda e: e.new_branch("a", PROMPT))
    first = both(engines, lambda e: e.next_logits(["a"]))
    torch.testing.assert_close(first[1], first[0], rtol=0, atol=1e-4)
    tokens = both(engines, lambda e: e.generate(["a"], 64, GREEDY)[0])
    assert tokens[1] == tokens[0] and len(tokens[0]) == 64
    last = both(engines, lambda e: e.next_logits(["a"]))
    torch.testing.assert_close(last[1], last[0], rtol=0, atol=1e-4)
    assert engine_state(two) == engine_state(one)   # the same tree and blocks: rank 0 allocates as one process does
    two.audit()


def test_a_fork_continued_equals_the_linear_run(engines):
    forked, linear = fork_and_linear_tokens(engines[1], PROMPT)
    assert forked == linear


def test_branches_decoding_in_one_batch_match_one_process(engines):
    """Four forks of a 19-token prompt (a shared partial block: copy-on-write on each), each given its own
    continuation in one prefill, then sampled together for 24 steps."""
    def run(engine):
        engine.new_branch("root", PROMPT)
        kids = engine.fork("root", n=4)
        engine.append_many([(kid, [7 * i + 1, 7 * i + 2, 7 * i + 3][: i + 1]) for i, kid in enumerate(kids)])
        return engine.generate(kids, 24, SAMPLED), engine.next_logits(kids)
    (tokens_one, logits_one), (tokens_two, logits_two) = both(engines, run)
    assert tokens_two == tokens_one
    assert len({tuple(t) for t in tokens_one}) > 1   # the branches went their own ways
    torch.testing.assert_close(logits_two, logits_one, rtol=0, atol=1e-4)


def test_rewind_inside_a_shared_block_then_grow(engines):
    """A rewind that cuts a shared node inside a block copies that block (every rank must copy it)."""
    def run(engine):
        engine.new_branch("r", PROMPT)
        engine.generate(["r"], 20, GREEDY)
        engine.fork("r", names=["r2"])
        engine.rewind("r", 25)
        engine.append("r", [11])
        return engine.generate(["r"], 16, GREEDY)[0], engine.generate(["r2"], 8, GREEDY)[0]
    results = both(engines, run)
    assert results[1] == results[0]


@pytest.mark.parametrize("host_bytes", [None, 0], ids=["parked-in-host-memory", "recomputed"])
def test_a_preempted_branch_resumes_exactly(engines, host_bytes):
    """Preempted KV gathered from both ranks into host memory and split again on resume (or dropped and
    recomputed): decoding goes on as in one process."""
    def run(engine):
        engine.host_memory_limit_bytes = host_bytes
        engine.new_branch("p", PROMPT)
        engine.generate(["p"], 30, GREEDY)
        freed = engine.preempt("p")
        return freed, engine.generate(["p"], 20, GREEDY)[0]
    try:
        results = both(engines, run)
    finally:
        for engine in engines:
            engine.host_memory_limit_bytes = None
    assert results[1] == results[0] and results[0][0] > 0


def test_ctrl_c_mid_step_stops_every_rank_at_the_step_boundary(engines, sigint_raises, monkeypatch):
    """SIGINT to every process during a forward's collectives (a terminal's Ctrl-C reaches the whole process group):
    the step finishes on every rank, generate stops after it, and decoding goes on as if nothing had happened."""
    one, two = engines
    one.new_branch("c", PROMPT)
    linear = one.generate(["c"], 12, GREEDY)[0]
    two.new_branch("c", PROMPT)
    group, calls = two._tensor_group, {"n": 0}
    real = group.channels.all_reduce

    def interrupted(tensor, buffer=0):
        calls["n"] += 1
        if calls["n"] == 10:   # inside the third step's forward (two all-reduces a layer, two layers)
            for pid in (os.getpid(), *group.pids):
                os.kill(pid, signal.SIGINT)
        real(tensor, buffer)

    monkeypatch.setattr(group.channels, "all_reduce", interrupted)
    with pytest.raises(GenerationInterrupted) as stopped:
        two.generate(["c"], 12, GREEDY)
    monkeypatch.undo()
    done = stopped.value.outputs[0]
    assert 0 < len(done) < 12
    assert done + two.generate(["c"], 12 - len(done), GREEDY)[0] == linear


def test_from_pretrained_matches_one_process(checkpoint):
    """A checkpoint with biases on all four attention products and the MLP (rank 0 adds the row-split ones once),
    loaded by every rank from the file; prompts as text through the tokenizer."""
    folder = checkpoint("llama-biased")
    one = Engine.from_pretrained(folder, num_blocks=32)
    two = Engine.from_pretrained(folder, num_blocks=32, tensor_parallel=2)
    try:
        assert two.source == one.source
        for engine in (one, two):
            engine.new_branch("t", "the quick brown fox")
        assert two.generate(["t"], 24, GREEDY) == one.generate(["t"], 24, GREEDY)
        torch.testing.assert_close(two.next_logits(["t"]), one.next_logits(["t"]), rtol=0, atol=1e-4)
        texts = []
        for engine in (one, two):   # a grammar masks rank 0's logits, as in one process
            engine.fork("t", names=["c"])
            engine.generate(["c"], 16, GREEDY, constraint={"regex": "(yes|no)!"})
            texts.append(engine.text("c"))
        assert texts[1] == texts[0] and texts[0].endswith(("yes!", "no!"))
    finally:
        two.close()
        one.close()


def test_an_fp8_cache_matches_one_process():
    """KV stored as fp8 with a scale per token and KV head: each rank quantises its own heads, and preemption moves
    the scales with the blocks."""
    def run(engine):
        engine.new_branch("f", PROMPT)
        tokens = engine.generate(["f"], 16, GREEDY)[0]
        engine.preempt("f")
        return tokens + engine.generate(["f"], 8, GREEDY)[0], engine.next_logits(["f"])
    results = []
    for tensor_parallel in (1, 2):
        engine = Engine.from_random(CONFIG, num_blocks=16, kv_dtype="fp8", tensor_parallel=tensor_parallel)
        try:
            results.append(run(engine))
        finally:
            engine.close()
    assert results[1][0] == results[0][0]
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_split_as_the_whole_models_quantization(weights):
    """Each rank quantizes its part as the whole model's quantization would be cut: rank 0's o_proj (split by
    input columns) holds the whole o_proj's integers and scales for its columns, its int8 scales being the maximum
    over the ranks' parts; and the split engine's logits and greedy tokens follow one process's."""
    engines = [Engine.from_random(CONFIG, num_blocks=16, weights=weights, tensor_parallel=degree) for degree in (1, 2)]
    try:
        one, two = engines
        whole, part = (engine.model.model.layers[0].self_attn.o_proj for engine in engines)
        columns = whole.in_features // 2
        if weights == "int8":
            assert torch.equal(part.scale, whole.scale)
            assert torch.equal(part.qweight, whole.qweight[:, :columns])
        else:   # two int4 inputs a byte; one scale and zero per group of 32 inputs
            assert torch.equal(part.qweight, whole.qweight[:, :columns // 2])
            assert torch.equal(part.scale, whole.scale[:, :columns // 32])
            assert torch.equal(part.zero, whole.zero[:, :columns // 32])
        for engine in engines:
            engine.new_branch("q", PROMPT)
        logits = [engine.next_logits(["q"]) for engine in engines]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=QUANTIZED_ATOL)
        tokens = [engine.generate(["q"], 16, GREEDY)[0] for engine in engines]
        assert tokens[1] == tokens[0]
    finally:
        for engine in engines:
            engine.close()


def test_int4_at_a_degree_whose_parts_it_cannot_take_is_refused_before_anything_starts():
    config = TINY_SHAPES[SHAPE].hf_config(vocab_size=256, num_key_value_heads=4)   # splits 4 ways
    before = multiprocessing.active_children()
    with pytest.raises(TensorParallelError, match=r"each rank's part of o_proj is 64 x 16, which int4 cannot take"):
        Engine.from_random(config, num_blocks=8, weights="int4", tensor_parallel=4)
    assert multiprocessing.active_children() == before
    Engine.check_random(config, weights="int8", tensor_parallel=4)   # int8 has no groups to cut


@pytest.mark.parametrize("request_, error, message", [
    ({"tensor_parallel": 3}, TensorParallelError, r"tensor_parallel=3 cannot split .* runs at tensor_parallel 1, 2\."),
    ({"tensor_parallel": 0}, TensorParallelError, r"must be an int >= 1"),
    ({"tensor_parallel": "2"}, TensorParallelError, r"must be an int >= 1"),
    ({"tensor_parallel": 2, "weights": "fp8"}, ValueError, r"weights='fp8' has no fast product on cpu"),
    ({"tensor_parallel": 2, "cuda_graphs": True}, ValueError, r"cuda_graphs=True, but they need a CUDA device"),
    ({"tensor_parallel": 2, "attention": "bogus"}, ValueError, r"attention backend 'bogus' is not available"),
])
def test_a_request_that_cannot_run_starts_nothing(request_, error, message):
    before = multiprocessing.active_children()
    with pytest.raises(error, match=message):
        Engine.from_random(CONFIG, num_blocks=8, **request_)
    assert multiprocessing.active_children() == before

