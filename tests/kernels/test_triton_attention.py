"""The Triton attention backend (tree-aware decode, flat decode, prefill) against the torch reference.

On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), in float32 with
small shapes; the `gpu` tests repeat the checks on CUDA in float32 and bfloat16.
"""
import random

import numpy as np
import pytest
import torch

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.attention import BatchLayout, TorchAttention
from dendrite_nb.kv.cascade import build_segments, decode_layout
from dendrite_nb.testing import TINY_SHAPES

from tests.support.random_trees import random_tree

pytest.importorskip("triton")
from dendrite_nb.attention.triton_backend import INTERPRET_BLOCK_N, TritonAttention  # noqa: E402  (needs triton)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the interpreter runs only where CUDA is absent


def fill_random(eng: Engine, seed: int) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    eng.pool.kv.copy_(torch.randn(eng.pool.kv.shape, generator=generator).to(eng.pool.kv))


def check_coverage(layout: BatchLayout, block_size: int) -> None:
    """Every row reads each position of [0, kv_len) exactly once, and each segment names a block per
    logical block it spans (the attention tests check those blocks hold the right tokens)."""
    for row, kv in enumerate(layout.kv_lens):
        seen = []
        for seg in layout.segments:
            assert len(seg.blocks) == (seg.end - 1) // block_size - seg.start // block_size + 1
            if row in seg.rows:
                seen.extend(range(seg.start, seg.end))
        assert sorted(seen) == list(range(kv)), f"row {row} covers {len(seen)} of {kv} positions"


@pytest.mark.parametrize("min_shared", [1, 16, 64])
def test_segments_partition_each_context_and_share_nodes(min_shared):
    rng = random.Random(min_shared)
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=2048, block_size=4)
    leaves = random_tree(eng, rng, leaves=12, depth=3)
    layout = decode_layout(eng.branch_tree, leaves, min_shared_tokens=min_shared)
    check_coverage(layout, 4)
    shared = [seg for seg in layout.segments if len(seg.rows) > 1]
    assert shared, "a tree of forks must give shared segments"
    assert all(seg.end - seg.start >= min_shared for seg in shared)
    # the root prompt is read once for every leaf, not once per leaf
    assert any(seg.start == 0 and len(seg.rows) == len(leaves) for seg in layout.segments)
    flat_reads = sum(layout.kv_lens)
    tree_reads = sum(seg.end - seg.start for seg in layout.segments)
    assert tree_reads < flat_reads


def test_chain_of_nodes_read_by_the_same_rows_is_one_segment():
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=512, block_size=4)
    eng.prefix_reuse = False   # the kids' equal appends stay three nodes (reuse would put the three on one)
    trunk = eng.new_branch("t", list(range(10)))
    keep = eng.fork(trunk, names=["keep", "other"])  # trunk's node is now frozen; keep grows a child node
    eng.append(keep[0], list(range(10, 40)))
    kids = eng.fork(keep[0], 3)
    for kid in kids:
        eng.append(kid, [1, 2])
    layout = decode_layout(eng.branch_tree, kids, min_shared_tokens=1)
    shared = [seg for seg in layout.segments if len(seg.rows) == 3]
    assert [(seg.start, seg.end) for seg in shared] == [(0, 40)]  # two nodes, one run


DECODE_SHAPES = ["llama-gqa-untied", "qwen3-gqa-tied", "llama-mha-tied"]


@pytest.fixture(scope="module")
def grown_trees():
    """grown_trees(device, shape) -> (engine, leaves): ten leaves of a random tree whose KV the model wrote
    (copy-on-write tails included), grown once per module: the decode tests below only read it."""
    grown = {}

    def get(device: str, shape: str):
        if (device, shape) not in grown:
            eng = Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), device=device, num_blocks=1024,
                                     block_size=4)
            grown[device, shape] = eng, random_tree(eng, random.Random(7), leaves=10, depth=3)
        return grown[device, shape]

    return get


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("min_shared", [1, 64])
@pytest.mark.parametrize("tile_widths", [(64, 128), (32,)])  # (32,): a shared segment spans several tiles
def test_tree_decode_attention_matches_reference(device, shape, min_shared, tile_widths, grown_trees):
    eng, leaves = grown_trees(device, shape)
    kv = eng.pool.layers()[0]
    heads, head_dim = eng.config.num_heads, eng.config.head_dim
    q = torch.randn(len(leaves), heads, head_dim, device=device)
    tree_layout = decode_layout(eng.branch_tree, leaves, min_shared_tokens=min_shared)
    reference = TorchAttention()
    expected = reference.attend(reference.plan(tree_layout, 4, eng.device), q, kv)
    triton_backend = TritonAttention(tile_widths=tile_widths)
    triton_backend.configure(heads, eng.config.num_kv_heads)
    group = heads // eng.config.num_kv_heads
    widths = (16,) + tuple(w for w in tile_widths if w > 16)
    tiles = {next((w for w in widths if len(seg.rows) * group <= w), widths[-1]) for seg in tree_layout.segments}
    host = triton_backend.host_plan(tree_layout, 4, eng.device)
    assert {block_m for block_m, count in host.shape().items if count} == tiles
    got = triton_backend.attend(triton_backend.plan(tree_layout, 4, eng.device), q, kv)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_flat_decode_attention_matches_the_tree_reference(device, shape, grown_trees):
    """The same leaves each reading their whole context alone (shared=False): one row a run, so neither the tree
    test's min_shared nor its tile widths change this plan; it runs once per shape."""
    eng, leaves = grown_trees(device, shape)
    kv = eng.pool.layers()[0]
    heads, head_dim = eng.config.num_heads, eng.config.head_dim
    q = torch.randn(len(leaves), heads, head_dim, device=device)
    reference = TorchAttention()
    expected = reference.attend(reference.plan(decode_layout(eng.branch_tree, leaves, min_shared_tokens=1), 4,
                                               eng.device), q, kv)
    triton_backend = TritonAttention()
    triton_backend.configure(heads, eng.config.num_kv_heads)
    flat = decode_layout(eng.branch_tree, leaves, shared=False)
    got = triton_backend.attend(triton_backend.plan(flat, 4, eng.device), q, kv)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_tma_tiles_of_consecutive_blocks_equal_the_block_table_path(device, shape):
    """With tma=True (the interpreter runs Triton's tensor descriptors; GPUs from Hopper pick it themselves),
    shared runs of consecutive blocks are planned in 64-wide tiles with linear slots and their unmasked steps
    load through the descriptors; the attention equals the torch reference and the block-table path."""
    rng = random.Random(11)
    cfg = TINY_SHAPES[shape].hf_config(vocab_size=256)
    eng = Engine.from_random(cfg, device=device, num_blocks=1024, block_size=4)
    trunk = eng.new_branch("trunk", [rng.randrange(256) for _ in range(70)])  # consecutive blocks, 4 KV steps
    kids = eng.fork(trunk, 12)
    for kid in kids:  # their own tails interleave in the pool: not consecutive across blocks
        eng.append(kid, [rng.randrange(256) for _ in range(rng.randrange(1, 9))])
    leaves = kids + random_tree(eng, rng, leaves=6, depth=2)
    kv = eng.pool.layers()[0]
    heads, head_dim = eng.config.num_heads, eng.config.head_dim
    q = torch.randn(len(leaves), heads, head_dim, device=device)
    layout = decode_layout(eng.branch_tree, leaves, min_shared_tokens=1)
    reference = TorchAttention()
    expected = reference.attend(reference.plan(layout, 4, eng.device), q, kv)
    tma = TritonAttention(tma=True)
    tma.configure(heads, eng.config.num_kv_heads, kv.k.dtype)
    assert tma.uses_tma(eng.device, kv.k.dtype)
    host = tma.host_plan(layout, 4, eng.device)
    assert_linear_slots_are_the_block_tables(host, block_size=4)
    wide = host.items[64]
    steps = (wide[:, 6] >= 0) & (wide[:, 3] - wide[:, 2] >= INTERPRET_BLOCK_N)  # items with an unmasked TMA step
    assert steps.any() and not host.items[128].size  # the 12 kids' 24 query vectors fit one 64-wide tile
    got = tma.attend(tma.plan(layout, 4, eng.device), q, kv)
    assert (got - expected).abs().max() < 1e-5
    plain = TritonAttention(tma=False)
    plain.configure(heads, eng.config.num_kv_heads, kv.k.dtype)
    assert (plain.host_plan(layout, 4, eng.device).items[64][:, 6] == -1).all()
    assert "tma=False" in plain.tma_reason(eng.device, kv.k.dtype)
    assert (plain.attend(plain.plan(layout, 4, eng.device), q, kv) - got).abs().max() < 1e-5
    fp8 = TritonAttention(tma=True).tma_reason(eng.device, torch.float8_e4m3fn)
    assert fp8 is not None and "fp8" in fp8
    # Prefills keep the block-table loads and their 128-wide tiles (TMA's were slower there), and a graph captured
    # for one kind of plan is not replayed for the other.
    prefill = BatchLayout(q_lens=[70], kv_lens=[70], block_tables=[list(range(18))])
    prefill_host = tma.host_plan(prefill, 4, eng.device)
    assert not prefill_host.linear and all((items[:, 6] == -1).all() for items in prefill_host.items.values())
    assert host.linear and host.shape().linear and not host.shape().fits(plain.host_plan(layout, 4, eng.device).shape())


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_attention_matches_reference_from_mid_block(device):
    eng = Engine.from_random(TINY_SHAPES["qwen3-gqa-tied"].hf_config(vocab_size=256), device=device,
                             num_blocks=256, block_size=4)
    fill_random(eng, 2)
    kv = eng.pool.layers()[1]
    # three sequences: a fresh prompt, one continuing mid-block, one adding a single token
    layout = BatchLayout(q_lens=[9, 6, 1], kv_lens=[9, 19, 30],
                         block_tables=[[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]])
    q = torch.randn(16, eng.config.num_heads, eng.config.head_dim, device=device)
    reference = TorchAttention()
    expected = reference.attend(reference.plan(layout, 4, eng.device), q, kv)
    backend = TritonAttention()
    backend.configure(eng.config.num_heads, eng.config.num_kv_heads)
    got = backend.attend(backend.plan(layout, 4, eng.device), q, kv)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-mha-untied"])
def test_triton_engine_matches_torch_engine_token_for_token(shape, checkpoint):
    steps = 64 if torch.cuda.is_available() else 8  # interpreted: a step takes about a second; 8 cross two blocks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = checkpoint(shape)
    engines = [Engine.from_pretrained(folder, device=device, attention=name, num_blocks=256, block_size=4, debug=True)
               for name in ("torch", "triton")]
    results = []
    for eng in engines:
        trunk = eng.new_branch("trunk", "A tree of thought, with branches that share a prompt")
        eng.generate([trunk], 3, GREEDY)
        kids = eng.fork(trunk, 3)                     # mid-block fork: copy-on-write runs
        tokens = eng.generate(kids, steps, GREEDY)
        results.append((tokens, eng.next_logits(kids)))
        eng.audit()
    assert results[0][0] == results[1][0]
    assert (results[0][1] - results[1][1]).abs().max() < 1e-4


def test_triton_fork_matches_linear_run(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), device=DEVICES[0], attention="triton", num_blocks=256, block_size=4)
    sampled = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)
    trunk = eng.new_branch("trunk", "A tree of thought, with branches")
    eng.generate([trunk], 3, GREEDY)
    kids = eng.fork(trunk, 2)  # each is then run again alone, 9 one-row steps of about a second interpreted
    batched = eng.generate(kids, 6, sampled)
    for i, kid in enumerate(kids):
        alone = eng.new_branch(f"alone{i}", "A tree of thought, with branches", seed=kid.seed)
        eng.generate([alone], 3, GREEDY)
        assert eng.generate([alone], 6, sampled)[0] == batched[i]
        assert (eng.next_logits([alone]) - eng.next_logits([kid])).abs().max() < 1e-4


def test_auto_picks_a_backend_that_runs_here_and_bad_names_say_what_exists():
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), device=DEVICES[0],
                             num_blocks=16, attention="auto")
    assert eng.backend.name == ("triton" if torch.cuda.is_available() else "torch-tree")
    with pytest.raises(ValueError, match="choose one of"):
        Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=16,
                           attention="fastest")


def test_a_plan_padded_for_a_graph_computes_the_same_attention():
    """CUDA graphs pad every plan section; padding items, slots and tokens must change nothing."""
    rng = random.Random(3)
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), device=DEVICES[0],
                             num_blocks=1024, block_size=4)
    leaves = random_tree(eng, rng, leaves=6, depth=2)
    kv = eng.pool.layers()[0]
    backend = TritonAttention()
    backend.configure(eng.config.num_heads, eng.config.num_kv_heads)
    layout = decode_layout(eng.branch_tree, leaves, min_shared_tokens=1)
    q = torch.randn(8, eng.config.num_heads, eng.config.head_dim, device=DEVICES[0])  # 6 rows padded to 8
    exact = backend.attend(backend.plan(layout, 4, eng.device), q[:6], kv)
    shape = backend.host_plan(layout, 4, eng.device).shape().padded(8)
    before = eng.pool.kv.clone()
    padded = backend.plan(layout, 4, eng.device, shape=shape, trash_slot=eng.pool.sink_slot)
    got = backend.attend(padded, q, kv)
    backend.append_kv(padded, kv, torch.ones(8, 2, 16, device=DEVICES[0]), torch.ones(8, 2, 16, device=DEVICES[0]))
    assert torch.equal(got[:6], exact)
    assert torch.equal(got[6:], torch.zeros_like(got[6:]))  # padding rows own no slots
    written = (eng.pool.kv != before).any(dim=(0, 1, 3, 4, 5)).nonzero().flatten().tolist()
    tables = {b for leaf in leaves for b in eng.branch_tree.block_table(leaf.node)[-2:]}
    assert eng.pool.num_blocks in written and set(written) <= tables | {eng.pool.num_blocks}  # the sink


def test_each_tile_width_is_chunked_for_its_own_launch_and_short_runs_are_flagged():
    """Launches run one after another, so each tile width's runs are cut to fill the GPU on their own: a long
    shared prefix splits by its own work, not by the whole plan's (which made the prefix's launch too coarse)."""
    from dendrite_nb.attention.triton_plan import SHORT_RUN_TOKENS, build_host_plan

    def plan_for(own_tokens: int):
        asked = []

        def chunk_for(work: int) -> int:
            asked.append(work)
            return 256 if work >= 4096 else 4096  # the prefix's launch splits; the leaves' runs stay whole
        prefix = (range(8), 0, 4096, range(256))  # 8 rows x 4 heads: 64-wide
        leaves = [([row], 4096, 4096 + own_tokens, [256 + row]) for row in range(8)]
        host = build_host_plan([prefix, *leaves], [4096 + own_tokens - 1] * 8, list(range(8)), 16, group=4,
                               widths=(16, 64, 128), chunk_for=chunk_for)
        return host, asked

    host, asked = plan_for(own_tokens=SHORT_RUN_TOKENS)
    assert sorted(asked) == [8 * SHORT_RUN_TOKENS, 4096]  # one call per launch, with that launch's work only
    assert len(host.items[64]) == 4096 // 256 and len(host.items[16]) == 8 and len(host.items[128]) == 0
    assert host.shape().short_runs
    longer, _ = plan_for(own_tokens=SHORT_RUN_TOKENS + 1)
    assert not longer.shape().short_runs
    # A graph captured with short-run launches is not reused for a plan without them, and the reverse.
    assert not host.shape().padded(8).fits(longer.shape()) and not longer.shape().padded(8).fits(host.shape())
    assert host.shape().padded(8).fits(host.shape())


def test_a_plan_for_a_named_gpu_cuts_as_that_gpu_would():
    """multiprocessors= plans for that many SMs on any device (benchmarks/host_step.py times GPU plans on the
    CPU), where the interpreter would otherwise cut every run into small chunks."""
    backend = TritonAttention()
    backend.configure(16, 8)
    assert backend._chunker(torch.device("cpu"))(32768) == backend.min_chunk_tokens // 2
    backend.multiprocessors = 132
    chunk = backend._chunker(torch.device("cpu"))(32768)  # 16 tiles x 2,048 positions x 8 KV heads over 264 programs
    assert chunk == 1024 and chunk % 64 == 0


@pytest.mark.parametrize("seed", range(6))
def test_array_plan_equals_the_run_by_run_plan(seed):
    """Many runs are planned with arrays over all of them at once, a few one run at a time: both must give the
    same items, slots and index arrays, for decode trees (shared and flat) and prefills from mid-block."""
    from dendrite_nb.attention.triton_plan import KVRuns, plan_by_arrays, plan_by_loop

    rng = random.Random(seed)
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=4096, block_size=4)
    leaves = random_tree(eng, rng, leaves=rng.randrange(2, 40), depth=rng.randrange(1, 4))
    prefill = BatchLayout(q_lens=[9, 6, 1, 40], kv_lens=[9, 19, 30, 41],
                          block_tables=[[0, 1, 2], [3, 4, 5, 6, 7], list(range(8, 16)), list(range(16, 27))])
    layouts = [decode_layout(eng.branch_tree, leaves, min_shared_tokens=rng.choice([1, 8, 64])),
               decode_layout(eng.branch_tree, leaves, shared=False), prefill]
    chunk = rng.choice([8, 32, 64])
    for layout in layouts:
        runs = TritonAttention._runs(layout)
        positions = layout.positions
        for group, widths in ((1, (16,)), (4, (16, 64, 128)), (8, (16, 32))):
            by_loop = plan_by_loop(runs, positions, positions, 4, group, widths, lambda work: chunk)
            by_arrays = plan_by_arrays(KVRuns.of(runs), np.array(positions), positions, 4, group, widths,
                                       lambda work: chunk)
            assert list(by_loop.items) == list(by_arrays.items) == list(widths)
            for width in widths:
                assert by_loop.items[width].tolist() == by_arrays.items[width].tolist()
            for field in ("entry_rows", "entry_pos", "block_ids", "indptr", "slots", "slot_mapping"):
                assert getattr(by_loop, field).tolist() == getattr(by_arrays, field).tolist(), field
            assert by_loop.num_slots == by_arrays.num_slots and by_loop.shape() == by_arrays.shape()
            if 64 in widths:  # runs of consecutive blocks marked for TMA, in tiles of at most 64
                loop = plan_by_loop(runs, positions, positions, 4, group, widths, lambda work: chunk, 64)
                arrays = plan_by_arrays(KVRuns.of(runs), np.array(positions), positions, 4, group, widths,
                                        lambda work: chunk, 64)
                for width in widths:
                    assert loop.items[width].tolist() == arrays.items[width].tolist()
                assert_linear_slots_are_the_block_tables(loop, block_size=4)
                assert (loop.items[128][:, 6] == -1).all()  # consecutive runs take 64-wide tiles at most
    assert KVRuns.of([]).rows.size == 0


def assert_linear_slots_are_the_block_tables(host, block_size: int) -> None:
    """Every item's linear slot is -1 exactly when its positions' blocks are not consecutive, and otherwise the
    cache slot of each position p is linear slot + p - kv_start."""
    for items in host.items.values():
        for _, _, start, end, block_off, _, linear in items.tolist():
            slots = [int(host.block_ids[block_off + p // block_size]) * block_size + p % block_size
                     for p in range(start, end)]
            if linear >= 0:
                assert slots == list(range(linear, linear + end - start))
            else:  # not marked: some block of the item's run (maybe in another chunk) breaks the sequence
                assert linear == -1


@pytest.mark.gpu
def test_cuda_graph_steps_equal_eager_steps(checkpoint):
    engines = [Engine.from_pretrained(checkpoint(), device="cuda", attention="triton", num_blocks=512, block_size=4,
                                      cuda_graphs=graphs, debug=True) for graphs in (False, True)]
    results = []
    for eng in engines:
        trunk = eng.new_branch("trunk", "A tree of thought, with branches that share a prompt")
        first = eng.generate([trunk], 5, GREEDY)
        kids = eng.fork(trunk, 3)
        middle = eng.generate(kids, 20, GREEDY)
        more = eng.fork(kids[1], 6)    # the batch grows past a bucket and the tree deepens
        last = eng.generate(kids + more, 30, SamplingParams(temperature=1.0, seed=5, ignore_eos=True))
        results.append((first, middle, last, eng.next_logits(kids + more)))
        eng.audit()
    assert results[0][:3] == results[1][:3]
    assert (results[0][3] - results[1][3]).abs().max() < 1e-4
    assert engines[1]._graphs.captures >= 2 and engines[0]._graphs is None


@pytest.mark.gpu
def test_cuda_graph_prefills_equal_eager_prefills(checkpoint):
    """Forks given short instructions: the first prefill of a shape runs eagerly, the second captures a graph,
    later ones (another instruction length in the same bucket included) replay it. Every round's logits and
    tokens equal an engine without graphs."""
    results, captures = [], []
    for graphs in (False, True):
        eng = Engine.from_pretrained(checkpoint(), device="cuda", attention="triton", num_blocks=512, block_size=4,
                                     cuda_graphs=graphs, debug=True)
        trunk = eng.new_branch("trunk", "One document that many analyses fork from")
        vocab = eng.config.vocab_size
        rounds, counts = [], []
        for round_, length in enumerate((6, 6, 6, 5)):
            kids = eng.fork(trunk, 3)
            eng.append_many((kid, [(round_ * 31 + i * 7 + j) % vocab for j in range(length + i)])
                            for i, kid in enumerate(kids))
            logits = eng.next_logits(kids)
            rounds.append((logits, eng.generate(kids, 4, GREEDY)))
            counts.append(eng._graphs.captures if graphs else 0)
            eng.prune(kids)
        results.append(rounds)
        captures.append(counts)
        eng.audit()
    for (eager_logits, eager_tokens), (graph_logits, graph_tokens) in zip(*results):
        assert (eager_logits - graph_logits).abs().max() < 1e-4
        assert eager_tokens == graph_tokens
    decode_captures = captures[1][0]  # the first round captured its decode steps' graphs, not its prefill's
    assert captures[1][1] == decode_captures + 1  # the second sight of the prefill shape captured it
    assert captures[1][3] == captures[1][2] == captures[1][1]  # replayed, the shorter instructions included


@pytest.mark.gpu
def test_cuda_graph_steps_of_many_rows_equal_eager_steps(checkpoint):
    """24 leaves: the graphs capture their products through skinny (kernels.products.graph_products), and the
    norms as their own kernels (more than skinny.FOLD_ROWS rows), while the eager engine runs them through
    torch's default cuBLAS."""
    results = []
    for graphs in (False, True):
        eng = Engine.from_pretrained(checkpoint(), device="cuda", attention="triton", num_blocks=512, block_size=4,
                                     cuda_graphs=graphs)
        kids = eng.fork(eng.new_branch("trunk", "Many branches of one prompt, decoded together"), 24)
        tokens = eng.generate(kids, 8, GREEDY)
        results.append((tokens, eng.next_logits(kids)))
        if graphs:
            assert eng._graphs.captures >= 1
        else:
            assert eng._graphs is None
    assert results[0][0] == results[1][0]
    assert (results[0][1] - results[1][1]).abs().max() < 1e-4


def test_graph_blas_preference_is_put_back_after_a_capture():
    from dendrite_nb.cuda_graphs import GRAPH_BLAS_LIBRARY, blas_library

    before = torch.backends.cuda.preferred_blas_library()
    with blas_library(GRAPH_BLAS_LIBRARY):
        inside = torch.backends.cuda.preferred_blas_library()
    assert torch.backends.cuda.preferred_blas_library() == before
    # A CPU build refuses cuBLASLt, and the preference is then left as it was.
    assert inside == before or str(inside).lower().endswith(GRAPH_BLAS_LIBRARY)


def test_segment_cache_equals_a_fresh_cut_as_leaves_grow_and_change():
    from dendrite_nb.kv.cascade import SegmentCache

    rng = random.Random(11)
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=2048, block_size=4)
    leaves = random_tree(eng, rng, leaves=8, depth=3)
    cache = SegmentCache(min_shared_tokens=8)
    for step in range(12):
        if step == 6:  # the rows change: a new cut
            leaves = leaves[:3] + eng.fork(leaves[3], 2)
            for leaf in leaves[3:]:
                eng.append(leaf, [1, 2, 3])
        nodes = [leaf.node for leaf in leaves]
        tables = [eng.branch_tree.block_table(node) for node in nodes]
        fresh = build_segments(eng.branch_tree, nodes, tables, min_shared_tokens=8)
        assert sorted(map(repr, cache.segments(eng.branch_tree, nodes, tables))) == sorted(map(repr, fresh))
        eng.append_many([(leaf, [rng.randrange(200)]) for leaf in leaves])


@pytest.mark.gpu
def test_bfloat16_triton_path_stays_within_1e_2_of_the_torch_reference():
    """The whole GPU fast path (Triton attention, fused decoder kernels, CUDA graphs) against the torch
    reference, in bf16 at a real head size, after a prompt and after a tree of decode steps.

    Measured against the reference run in float32 (the exact result of the same weights): the bf16 reference
    itself is 1.00% away from it here (H200), so a bf16 path that rounds in other places than the reference
    (the few-row products fold the norm with one rounding fewer) differs from the bf16 reference by about
    that much even where it is closer to the exact result (0.94%)."""
    from dendrite_nb.testing.shapes import REAL_SHAPES

    cfg = REAL_SHAPES["qwen3-0.6b"].hf_config(num_hidden_layers=2, vocab_size=512)
    fast = Engine.from_random(cfg, device="cuda", dtype="bfloat16", num_blocks=512)
    reference = Engine(fast.model, None, device="cuda", attention="torch", num_blocks=512)
    exact = Engine.from_random(cfg, device="cuda", dtype="float32", num_blocks=512, attention="torch")
    with torch.no_grad():
        for ours, theirs in zip(exact.model.parameters(), fast.model.parameters(), strict=True):
            ours.copy_(theirs.float())
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    results = []
    for eng in (fast, reference, exact):
        eng.model.use_fused_kernels(eng is fast)  # reference, exact: the plain torch decoder
        kids = eng.fork(eng.new_branch("root", prompt), 4)
        eng.append_many([(kid, [i + 1]) for i, kid in enumerate(kids)])
        results.append(eng.next_logits(kids).float())
    fast_logits, reference_logits, exact_logits = results

    def relative(logits, to):
        return ((logits - to).norm() / to.norm()).item()
    assert relative(fast_logits, exact_logits) < 1e-2
    assert relative(fast_logits, exact_logits) < 1.1 * relative(reference_logits, exact_logits)
    assert relative(fast_logits, reference_logits) < 1.5e-2  # the two bf16 paths' roundings, together


def _raw_step(eng: Engine, rows: int, dtype: torch.dtype, seed: int):
    """A decode step's raw projections as forward_fused has them: q, k, v views into one [T, qkv] product."""
    heads, kv_heads, head_dim = eng.config.num_heads, eng.config.num_kv_heads, eng.config.head_dim
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator).to(eng.device, dtype)
    norms = tuple((1 + 0.2 * torch.randn(head_dim, generator=generator)).to(eng.device, dtype) for _ in range(2))
    return qkv, norms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["qwen3-gqa-tied", "llama-gqa-untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICES == ["cuda"] else [torch.float32])
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_fused_decode_launch_equals_rope_append_and_attend(device, shape, dtype, kv_dtype):
    """A decode step of one-row runs takes two launches per layer (RoPE with the q/k norms, the KV append and
    the attention of each tile in one: triton_decode_kernel.py; then the merge). It must write the same KV (an
    fp8 cache: the same bytes and scales, quantised as kv_append quantises) and give the same output as the
    three launches of the general path, for rows of one tile and of many, a new token at a tile's first
    position included, and leave the raw projections as they were."""
    from dendrite_nb.model.rope import rope_cos_sin

    eng = Engine.from_random(TINY_SHAPES[shape].hf_config(vocab_size=256), device=device, dtype=str(dtype)[6:],
                             num_blocks=1024, block_size=4, kv_dtype=kv_dtype)
    rng = random.Random(5)
    tile = TritonAttention().one_tile_candidates()[0]
    lengths = [5, tile, tile + 1, 3 * tile - 1, 90]  # a new token at position `tile` opens a tile of its own
    leaves = [eng.new_branch(f"b{i}", [rng.randrange(200) for _ in range(n - 1)]) for i, n in enumerate(lengths)]
    eng.append_many([(leaf, [1]) for leaf in leaves])  # reserves each leaf's new slot (position n - 1)
    layout = decode_layout(eng.branch_tree, leaves, shared=False)
    kv = eng.pool.layers()[0]
    qkv, norms = _raw_step(eng, len(leaves), dtype, seed=1)
    positions = torch.tensor(layout.positions, device=eng.device)
    cos, sin = rope_cos_sin(eng.model.inv_freq, positions, dtype)
    heads, kv_heads = eng.config.num_heads, eng.config.num_kv_heads
    pool_tensors = [eng.pool.kv] + ([eng.pool.scales] if kv_dtype else [])
    before = [t.clone() for t in pool_tensors]
    results = []
    for programs_per_sm in (1.5, 0):  # the fused launch, then the general path
        for t, saved in zip(pool_tensors, before):
            t.copy_(saved)
        backend = TritonAttention(one_tile_programs_per_sm=programs_per_sm)
        backend.configure(heads, kv_heads)
        plan = backend.plan(layout, 4, eng.device)
        assert plan.one_tile == (tile if programs_per_sm > 0 else 0)
        step = qkv.clone()
        q, k, v = step.split([heads, kv_heads, kv_heads], dim=1)
        out = backend.attend_with_rope(plan, kv, q, k, v, cos, sin, norms, 1e-6).clone()
        if plan.one_tile:
            assert torch.equal(step, qkv)  # the fused launch rotates in registers: the projections stay raw
        results.append((out.float(), [t.clone() for t in pool_tensors]))
    (fused, fused_pool), (general, general_pool) = results
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fused - general).abs().max() < tolerance
    if kv_dtype:
        # The two kernels reduce the q/k norm's sum in different orders, so a new k may differ in its last bit,
        # and its scale (amax / 448) with it; a value on an e4m3 rounding boundary may then round one step the
        # other way (a step is at most 32 units of the scale: 256-448). Anything more is a wrong quantisation.
        (fused_kv, fused_scales), (general_kv, general_scales) = fused_pool, general_pool
        torch.testing.assert_close(fused_scales, general_scales, rtol=1e-5, atol=0)
        step = 32 * torch.maximum(fused_scales, general_scales)[..., None] * (1 + 1e-5)
        assert ((fused_kv.float() * fused_scales[..., None] - general_kv.float() * general_scales[..., None]).abs()
                <= step).all()
        # bf16 k rounds to the nearest bf16 after the norm, so those last bits become whole bf16 steps: a few
        # values of the step's new K land across a boundary (4 of 640 seen on an H100); a quantisation that
        # rounded the wrong way would move about half of them.
        written = len(leaves) * 2 * kv_heads * eng.config.head_dim
        assert (fused_kv.view(torch.uint8) != general_kv.view(torch.uint8)).sum() <= 0.05 * written
    else:
        assert (fused_pool[0].float() - general_pool[0].float()).abs().max() < tolerance
    assert not torch.equal(fused_pool[0].view(torch.uint8), before[0].view(torch.uint8))  # the step's KV went in


def test_partials_are_float32_unless_asked_to_take_the_activations_dtype():
    """Partial outputs are float32 by default; low_precision_partials stores a bf16 or fp16 model's in its own
    dtype (half the bytes a shared prefix's chunks write and the merge reads). Log-sum-exps stay float32."""
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=1024,
                             block_size=4)
    leaves = random_tree(eng, random.Random(3), leaves=3, depth=2)
    heads, kv_heads, head_dim = eng.config.num_heads, eng.config.num_kv_heads, eng.config.head_dim
    for dtype, low_precision, expected in ((torch.bfloat16, False, torch.float32),
                                           (torch.bfloat16, True, torch.bfloat16),
                                           (torch.float16, True, torch.float16),
                                           (torch.float32, True, torch.float32)):
        backend = TritonAttention(low_precision_partials=low_precision)
        backend.configure(heads, kv_heads)
        plan = backend.plan(decode_layout(eng.branch_tree, leaves, min_shared_tokens=1), 4, eng.device)
        out, lse = backend._scratch(plan, torch.zeros(len(leaves), heads, head_dim, dtype=dtype))
        assert out.dtype == expected and lse.dtype == torch.float32
        assert out.shape == (plan.num_slots, heads, head_dim) and lse.shape == (plan.num_slots, heads)


def test_fused_decode_launch_is_planned_for_one_row_runs_that_fit_the_gpu():
    """Shared segments, prefills and steps of more tiles than the GPU's programs keep the general kernels; a
    one-tile plan cuts every run into tiles of the fused launch's BLOCK_N."""
    eng = Engine.from_random(TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=256), num_blocks=1024,
                             block_size=4)
    leaves = random_tree(eng, random.Random(2), leaves=4, depth=2)
    backend = TritonAttention()
    backend.configure(eng.config.num_heads, eng.config.num_kv_heads)
    flat = decode_layout(eng.branch_tree, leaves, shared=False)
    assert backend.host_plan(flat, 4, eng.device).one_tile
    assert not backend.host_plan(decode_layout(eng.branch_tree, leaves, min_shared_tokens=1), 4, eng.device).one_tile
    prefill = BatchLayout(q_lens=[3], kv_lens=[3], block_tables=[[0]])
    assert not backend.host_plan(prefill, 4, eng.device).one_tile
    narrow, wide = backend.one_tile_candidates()
    kv_heads = eng.config.num_kv_heads
    backend.multiprocessors = 1  # as a GPU of one multiprocessor: too many tiles for its programs
    tiles = sum(-(-kv // wide) for kv in flat.kv_lens)
    assert tiles * kv_heads > backend.one_tile_programs_per_sm
    assert not backend.host_plan(flat, 4, eng.device).one_tile
    narrow_programs = sum(-(-kv // narrow) for kv in flat.kv_lens) * kv_heads
    assert narrow_programs > tiles * kv_heads  # the contexts span several narrow tiles
    # The narrowest width whose programs stay within one_tile_programs_per_sm a multiprocessor.
    fill = backend.one_tile_programs_per_sm
    for multiprocessors, width in ((int(narrow_programs / fill) + 1, narrow), (int(tiles * kv_heads / fill) + 1, wide)):
        backend.multiprocessors = multiprocessors
        host = backend.host_plan(flat, 4, eng.device)
        assert host.one_tile == width and host.shape().one_tile == width
        assert all(end - start <= width for _, _, start, end, *_ in host.items[16].tolist())
    # A graph captured for one tile width is not reused for another.
    backend.multiprocessors = int(narrow_programs / fill) + 1
    assert not backend.host_plan(flat, 4, eng.device).shape().fits(host.shape())
    # A graph captured for the fused launch is not reused for the general one, nor the reverse.
    general = TritonAttention(one_tile_programs_per_sm=0)
    general.configure(eng.config.num_heads, eng.config.num_kv_heads)
    other = general.host_plan(flat, 4, eng.device).shape()
    assert not host.shape().padded(8).fits(other) and not other.padded(8).fits(host.shape())
