"""Preemption: a tree that needs 3x the pool's blocks decodes under a priority order, the lowest-priority
leaves moved to host memory and resumed later, with exactly the tokens of a run with memory to spare."""
import pytest

from dendrite_nb import DecodeStep, Engine, OutOfBlocks, SamplingParams

from tests.support.engines import engine_state

SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, ignore_eos=True)
POOL = 46
STEPS = 44


def kids_with_priorities(eng: Engine) -> list[str]:
    trunk = eng.new_branch("trunk", "A tree of thought, with many")
    kids = eng.fork(trunk, 12)
    for rank, kid in zip([5, 11, 0, 7, 3, 9, 1, 10, 4, 8, 2, 6], kids):
        eng.set_priority(kid, float(rank))
    return [kid.name for kid in kids]


@pytest.fixture
def engines(checkpoint):
    tight = Engine.from_pretrained(checkpoint(), num_blocks=POOL, block_size=4, debug=True)
    roomy = Engine.from_pretrained(checkpoint(), num_blocks=1024, block_size=4)
    return tight, roomy


def test_a_tree_three_times_the_pool_decodes_exactly_high_priority_first(engines):
    tight, roomy = engines
    names = kids_with_priorities(tight)
    kids_with_priorities(roomy)
    expected = roomy.generate(names, STEPS, SAMPLED)
    needed = roomy.pool.num_blocks - roomy.num_free_blocks
    assert needed >= 3 * POOL  # the finished tree needs three pools
    done_at, counts = {}, dict.fromkeys(names, 0)

    def record(event):
        if isinstance(event, DecodeStep):
            for name in event.branches:
                counts[name] += 1
                if counts[name] == STEPS:
                    done_at[name] = event.step

    with tight.subscribe(record):
        outputs = tight.generate(names, STEPS, SAMPLED)
    assert outputs == expected
    tight.audit()  # refcounts, free list, canaries of every freed block; preempted nodes hold no blocks
    by_priority = sorted(names, key=lambda n: tight.branch(n).priority, reverse=True)
    assert [done_at[n] for n in by_priority] == sorted(done_at.values())
    # The preempted leaves resume on demand: their next tokens also match the roomy run.
    low = by_priority[-3:]
    assert tight.generate(low, 4, SAMPLED) == roomy.generate(low, 4, SAMPLED)
    assert (tight.next_logits(low) - roomy.next_logits(low)).abs().max() < 1e-4
    tight.audit()
    tight.prune(list(tight.branches))
    assert tight.num_free_blocks == POOL
    tight.audit()


def test_a_session_with_preempted_branches_saves_and_restores(engines, tmp_path):
    tight, roomy = engines
    names = kids_with_priorities(tight)
    kids_with_priorities(roomy)
    tight.generate(names, STEPS, SAMPLED)
    roomy.generate(names, STEPS, SAMPLED)
    restored = Engine.restore(tight.save(tmp_path / "s"))
    assert any(b.node.swapped_blocks for b in restored.branches.values())
    low = sorted(names, key=lambda n: restored.branch(n).priority)[:3]
    assert restored.generate(low, 3, SAMPLED) == roomy.generate(low, 3, SAMPLED)
    restored.audit()


def test_out_of_blocks_only_when_one_branch_alone_cannot_fit_and_then_nothing_changed(engines):
    tight, _ = engines
    names = kids_with_priorities(tight)
    before = engine_state(tight)
    with pytest.raises(OutOfBlocks, match="alone, the others preempted"):
        tight.generate(names, 4 * POOL, SAMPLED)
    assert engine_state(tight) == before
    tight.audit()


def test_with_no_host_memory_to_spare_preempted_leaves_are_recomputed(engines, tmp_path):
    tight, roomy = engines
    tight.host_memory_limit_bytes = 0  # nothing may be copied out: every preempted leaf is dropped
    names = kids_with_priorities(tight)
    kids_with_priorities(roomy)
    assert tight.generate(names, STEPS, SAMPLED) == roomy.generate(names, STEPS, SAMPLED)
    tight.audit()
    parked = [n for n in names if tight.branch(n).node.swapped_blocks]
    assert parked and all(tight.branch(n).node.swapped == "recompute" for n in parked)
    restored = Engine.restore(tight.save(tmp_path / "s"))  # a dropped leaf stays dropped across a restore
    assert all(restored.branch(n).node.swapped == "recompute" for n in parked)
    # Recomputed KV comes from one prefill instead of token-by-token decoding: equal up to float32 rounding.
    expected = roomy.generate(parked, 4, SAMPLED)
    for eng in (tight, restored):
        assert eng.generate(parked, 4, SAMPLED) == expected
        assert (eng.next_logits(parked) - roomy.next_logits(parked)).abs().max() < 1e-3
        eng.audit()


@pytest.mark.gpu
def test_preemption_on_cuda_with_graphs_swaps_through_pinned_host_memory(checkpoint):
    """The CUDA path: Triton attention, CUDA graphs, KV copied to pinned host memory and back."""
    import torch

    tight = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=POOL, block_size=4, debug=True)
    roomy = Engine.from_pretrained(checkpoint(), device="cuda", num_blocks=1024, block_size=4)
    names = kids_with_priorities(tight)
    kids_with_priorities(roomy)
    expected = roomy.generate(names, STEPS, SAMPLED)
    swapped = []

    def record(event):
        swapped.extend(n.swapped[0] for n in tight.branch_tree.nodes()
                       if n.swapped_blocks and isinstance(n.swapped, tuple))

    with tight.subscribe(record):
        assert tight.generate(names, STEPS, SAMPLED) == expected
    assert swapped and all(kv.device.type == "cpu" and kv.is_pinned() for kv in swapped)
    assert tight._graphs is not None and tight._graphs.captures >= 1
    low = sorted(names, key=lambda n: tight.branch(n).priority)[:3]
    assert tight.generate(low, 4, SAMPLED) == roomy.generate(low, 4, SAMPLED)
    assert torch.allclose(tight.next_logits(low), roomy.next_logits(low), atol=1e-4)
    tight.audit()
