"""Tensor parallelism over NCCL on two GPUs (skipped where fewer are present): an engine split over cuda:0 and cuda:1
against the same engine on cuda:0 alone, in float32 on a tiny checkpoint (greedy tokens over 64 steps, logits
within 1e-4, a fork continued, a batch of sampled branches, 32 forks decoding through CUDA graphs on both ranks
against eager steps, an eager prefill straight after graph steps, graphs dropped in step, a checkpoint read onto
each GPU), and in bfloat16 at a real shape and with fp8 weights (logits within bf16's tolerance); close() ends the
workers, a killed worker is a clear error within 30 s, and a hung one within the collective timeout."""
import os
import signal
import time

import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.errors import TensorParallelError
from dendrite_nb.testing import TINY_SHAPES
from tests.distributed.conftest import engine_pair, fork_and_linear_tokens
from tests.support.engines import engine_state

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=50)
CONFIG = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]


@pytest.fixture(scope="module")
def pair():
    """(one process, two processes): engines of the same random model."""
    yield from engine_pair(CONFIG, device="cuda")


def test_greedy_tokens_and_logits_match_one_gpu(engines):
    one, two = engines
    assert two.tensor_parallel == 2 and two._tensor_group.rank_device(1) == torch.device("cuda", 1)
    # peer memory is opt-in (distributed/peer_memory.py: OPT_IN): by default every all-reduce goes over NCCL
    assert two.tensor_all_reduce.startswith("NCCL (peer memory off: rank 0: set DENDRITE_PEER_MEMORY=1")
    for engine in engines:
        engine.new_branch("a", PROMPT)
    torch.testing.assert_close(two.next_logits(["a"]), one.next_logits(["a"]), rtol=0, atol=1e-4)
    tokens = [engine.generate(["a"], 64, GREEDY)[0] for engine in engines]
    assert tokens[1] == tokens[0]
    torch.testing.assert_close(two.next_logits(["a"]), one.next_logits(["a"]), rtol=0, atol=1e-4)
    assert engine_state(two) == engine_state(one)
    two.audit()


def test_a_fork_continued_equals_the_linear_run(engines):
    forked, linear = fork_and_linear_tokens(engines[1], PROMPT)
    assert forked == linear


def test_sampled_forks_in_one_batch_match_one_gpu(engines):
    def run(engine):
        engine.new_branch("root", PROMPT)
        kids = engine.fork("root", n=4)
        engine.append_many((kid, [7 + i] * (i + 1)) for i, kid in enumerate(kids))
        return engine.generate(kids, 24, SAMPLED)
    results = [run(engine) for engine in engines]
    assert results[1] == results[0]


def test_steps_replay_cuda_graphs_on_every_rank_with_the_eager_tokens(engines):
    """The split engine's decode steps and short prefills replay CUDA graphs (with the all-reduces inside) and its
    tokens equal those of the same split engine run eagerly and of one GPU: 32 forks of one prefix, each with an
    instruction of its own, decoding in one batch (the tree's shared prefix read once a step)."""
    one, two = engines
    assert two._graphs is not None

    def run(engine):
        engine.new_branch("root", PROMPT * 4)
        kids = engine.fork("root", n=32)
        engine.append_many((kid, [5 + i % 50, 9]) for i, kid in enumerate(kids))
        return engine.generate(kids, 12, GREEDY)
    captures = two._graphs.captures
    graphed = run(two)
    assert two._graphs.captures > captures
    eager = Engine.from_random(CONFIG, device="cuda", num_blocks=96, block_size=16, tensor_parallel=2,
                               cuda_graphs=False)
    try:
        assert eager._graphs is None and eager.model.fused_kernels
        assert run(eager) == graphed
    finally:
        eager.close()
    assert run(one) == graphed


def test_a_collective_outside_a_graph_waits_for_the_graphs_before_it(engines):
    """NCCL runs without graph mixing support (distributed/channels.py), which asks that no collective be launched
    outside a graph while a graph with collectives may run: decode steps replay graphs, an eager prefill (over
    PREFILL_GRAPH_RUN_TOKENS) comes straight after them and first waits for them, and the tokens equal one GPU's."""
    one, two = engines
    assert os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0"
    channels = two._tensor_group.channels

    def run(engine):
        engine.new_branch("mixed", PROMPT)
        tokens = engine.generate(["mixed"], 8, GREEDY)[0]
        assert engine is one or channels.graph_pending
        engine.append("mixed", PROMPT * 12)
        assert engine is one or not channels.graph_pending
        return tokens + engine.generate(["mixed"], 8, GREEDY)[0]
    assert run(two) == run(one)


def test_graphs_rank_0_drops_are_dropped_by_the_workers(engines, monkeypatch):
    """With room for two graphs, batches of 1, 2, 4, 1 and 2 leaves capture, drop and capture again: the workers
    drop what rank 0 drops (it tells them), so every replay pairs with the worker's graph of the same step."""
    import dendrite_nb.cuda_graphs as cuda_graphs

    one, two = engines
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)

    def run(engine):
        engine.new_branch("root", PROMPT)
        out = []
        for width in (1, 2, 4, 1, 2):
            kids = engine.fork("root", n=width)
            out += engine.generate(kids, 3, GREEDY)
            engine.prune(*kids)
        return out
    assert run(two) == run(one)
    assert len(two._graphs._graphs) <= 2


def test_a_checkpoint_read_onto_each_gpu_a_tensor_at_a_time_matches_one_gpu(tmp_path):
    """Engine.from_pretrained at TP=2 on the GPUs: each rank reads the file's tensors one at a time onto its own
    GPU and keeps its part (biases on every product, the row-split ones added once): the same tokens and logits
    as one GPU."""
    from dendrite_nb.testing import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "llama-biased", seed=2)
    engines = [Engine.from_pretrained(folder, device="cuda", num_blocks=32, tensor_parallel=degree)
               for degree in (1, 2)]
    try:
        for engine in engines:
            engine.new_branch("t", "the quick brown fox")
        torch.testing.assert_close(engines[1].next_logits(["t"]), engines[0].next_logits(["t"]), rtol=0, atol=1e-4)
        assert engines[1].generate(["t"], 24, GREEDY) == engines[0].generate(["t"], 24, GREEDY)
    finally:
        for engine in engines:
            engine.close()


def test_real_shape_logits_within_bfloat16_tolerance():
    """Qwen3-0.6B's shape in bfloat16 (random weights): TP=2's next-token logits against one GPU's, relative to
    their scale, as bf16 rounding of differently summed partial products allows."""
    from dendrite_nb.testing.shapes import REAL_SHAPES

    config = REAL_SHAPES["qwen3-0.6b"].hf_config()
    prompt = list(range(100, 400))
    logits = []
    for degree in (1, 2):
        engine = Engine.from_random(config, device="cuda", dtype="bfloat16", num_blocks=64, block_size=16,
                                    tensor_parallel=degree)
        try:
            engine.new_branch("a", prompt)
            logits.append(engine.next_logits(["a"]).float())
            tokens = engine.generate(["a"], 16, GREEDY)[0]
        finally:
            engine.close()
    scale = logits[0].abs().max()
    assert (logits[1] - logits[0]).abs().max() <= 0.05 * scale
    assert tokens   # both ran a decode; bf16 rounding may part their greedy paths, so they are not compared


def test_fp8_weights_split_as_the_whole_models_quantization():
    """fp8 weights at TP=2 in bfloat16: rank 0's o_proj (split by input columns) holds the whole o_proj's e4m3
    values and scales for its columns, and the next-token logits follow one GPU's within bf16's tolerance."""
    engines = [Engine.from_random(CONFIG, device="cuda", dtype="bfloat16", num_blocks=32, weights="fp8",
                                  tensor_parallel=degree) for degree in (1, 2)]
    try:
        whole, part = (engine.model.model.layers[0].self_attn.o_proj for engine in engines)
        columns = whole.in_features // 2
        assert torch.equal(part.scale, whole.scale)
        assert torch.equal(part.qweight.view(torch.uint8), whole.qweight[:, :columns].view(torch.uint8))
        logits = []
        for engine in engines:
            engine.new_branch("a", PROMPT)
            logits.append(engine.next_logits(["a"]).float())
            assert engine.generate(["a"], 8, GREEDY)[0]   # graphs with fp8 products on every rank
        assert (logits[1] - logits[0]).abs().max() <= 0.05 * logits[0].abs().max()
    finally:
        for engine in engines:
            engine.close()


def test_close_ends_the_workers_and_a_killed_worker_is_a_clear_error():
    first = Engine.from_random(CONFIG, device="cuda", num_blocks=16, tensor_parallel=2)
    (pid,) = first._tensor_group.pids
    first.new_branch("a", [1, 2, 3])
    tokens = first.generate(["a"], 8, GREEDY)
    first.close()
    assert not first._tensor_group.processes[0].is_alive()
    second = Engine.from_random(CONFIG, device="cuda", num_blocks=16, tensor_parallel=2)
    try:
        second.new_branch("a", [1, 2, 3])
        assert second.generate(["a"], 8, GREEDY) == tokens
        before = engine_state(second)
        (pid,) = second._tensor_group.pids
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="SIGKILL"):
            second.generate(["a"], 4, GREEDY)
        assert time.monotonic() - started < 30
        assert engine_state(second) == before
    finally:
        second.close()


def test_a_hung_worker_is_a_clear_error_not_a_hang():
    """A stopped worker (SIGSTOP: alive, but answering nothing) while steps replay CUDA graphs, whose collectives have
    no timeout of their own: the next call ends in a TensorParallelError within COLLECTIVE_TIMEOUT and the workers'
    end, the tree as it was. (On 2 x H100 the command that names the step's graph timed out first: the worker never
    took it. A worker that hangs after taking it leaves rank 0 in ForwardRunner.read_back's wait, which has the
    same deadline, TensorGroup.wait_for.)"""
    from dendrite_nb.distributed.channels import COLLECTIVE_TIMEOUT

    engine = Engine.from_random(CONFIG, device="cuda", num_blocks=16, tensor_parallel=2)
    try:
        engine.new_branch("a", [1, 2, 3])
        engine.generate(["a"], 8, GREEDY)   # captures the decode step's graph
        before = engine_state(engine)
        (pid,) = engine._tensor_group.pids
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"(?i)(timed out|did not finish).*cannot run any more"):
            engine.generate(["a"], 4, GREEDY)
        assert time.monotonic() - started < COLLECTIVE_TIMEOUT.total_seconds() + 25
        assert engine_state(engine) == before
        assert not engine._tensor_group.processes[0].is_alive()
    finally:
        engine.close()


def test_a_session_saved_at_tp_2_restores_on_one_gpu(tmp_path):
    """Saved from two GPUs (every rank's KV gathered), restored on one: the same tree, logits and greedy tokens as
    the saved engine goes on with."""
    two = Engine.from_random(CONFIG, device="cuda", num_blocks=32, block_size=16, tensor_parallel=2)
    try:
        two.new_branch("trunk", PROMPT)
        two.generate(["trunk"], 7, GREEDY)
        two.fork("trunk", names=["kid"])
        two.generate(["trunk", "kid"], 5, SAMPLED)
        path = two.save(tmp_path / "two.dendrite")
        state, logits = engine_state(two), two.next_logits(["trunk", "kid"])
        expected = two.generate(["trunk", "kid"], 12, GREEDY)
    finally:
        two.close()
    one = Engine.restore(path)
    try:
        assert one.tensor_parallel == 1 and engine_state(one) == state
        torch.testing.assert_close(one.next_logits(["trunk", "kid"]), logits, rtol=0, atol=1e-4)
        assert one.generate(["trunk", "kid"], 12, GREEDY) == expected
    finally:
        one.close()


def test_cycles_of_build_generate_and_close_leave_no_worker_or_port():
    """DENDRITE_TP_CYCLES (default 3) engines over NCCL, one after another, each capturing graphs: after each
    close no worker process of this one is left and the store's port is closed."""
    import multiprocessing

    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    children_before = set(multiprocessing.active_children())   # the module's pair of engines, still open
    listening_before = {c.laddr for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    tokens = None
    for cycle in range(int(os.environ.get("DENDRITE_TP_CYCLES", "3"))):
        engine = Engine.from_random(CONFIG, device="cuda", num_blocks=16, tensor_parallel=2)
        engine.new_branch("a", PROMPT)
        out = engine.generate(["a"], 8, GREEDY)
        tokens = tokens or out
        assert out == tokens, cycle
        engine.close()
        assert set(multiprocessing.active_children()) == children_before, cycle
        listening = {c.laddr for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert listening <= listening_before, (cycle, listening - listening_before)
