"""Fork consistency and isolation: a fork decodes exactly like a linear run, and writes never leak across branches."""
import torch

from dendrite_nb import Engine, SamplingParams

from tests.support.engines import decode_recording_logits

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, ignore_eos=True)
PROMPT = "A tree of thought, with branches"  # tokenizes to a length that is not a multiple of 4


def branch_kv(eng, branch):
    """The KV a branch reads: [layers, 2, tokens, kv_heads, head_dim], gathered through its block table."""
    table = eng.branch_tree.block_table(branch.node)
    kv = eng.pool.kv[:, :, table]  # [L, 2, blocks, block, H, D]
    return kv.flatten(2, 3)[:, :, : len(branch)].clone()


def test_fork_at_t3_decodes_like_a_linear_run(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=128, block_size=8, debug=True)
    trunk = eng.new_branch("trunk", PROMPT)
    eng.generate([trunk], 3, GREEDY)
    assert len(trunk) % 8 != 0, "the fork point must be mid-block to exercise copy-on-write"
    child, sibling = eng.fork(trunk, names=["child", "sibling"])
    eng.generate([sibling], 5, SAMPLED)  # the sibling copies the shared tail block first
    child_logits = decode_recording_logits(eng, child, 20, SAMPLED)

    eng.prefix_reuse = False   # a linear run of its own: prefilled afresh, not reading the trunk's KV
    linear = eng.new_branch("linear", PROMPT, seed=child.seed)
    eng.generate([linear], 3, GREEDY)
    linear_logits = decode_recording_logits(eng, linear, 20, SAMPLED)
    assert child.tokens == linear.tokens
    assert (child_logits - linear_logits).abs().max() < 1e-5
    eng.audit()


def test_eight_siblings_in_one_batch_match_eight_linear_runs(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=256, block_size=4, debug=True)
    trunk = eng.new_branch("trunk", PROMPT)
    kids = eng.fork(trunk, 8)
    batched = eng.generate(kids, 16, SAMPLED)
    batched_logits = eng.next_logits(kids)
    assert len({tuple(out) for out in batched}) > 1, "siblings draw from different seeds"
    for i, kid in enumerate(kids):
        alone = eng.new_branch(f"alone{i}", PROMPT, seed=kid.seed)
        assert eng.generate([alone], 16, SAMPLED)[0] == batched[i]
        # Tokens are exact; logits agree to float32 GEMM rounding, which differs between batch shapes
        # (about 2e-5 on logits of magnitude 5 after 16 steps), so the bar is the transformers-parity 1e-4.
        assert (eng.next_logits([alone])[0] - batched_logits[i]).abs().max() < 1e-4
    eng.audit()


def test_greedy_siblings_in_a_batch_agree_with_their_parent_run(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=128, block_size=4)
    trunk = eng.new_branch("trunk", PROMPT)
    kids = eng.fork(trunk, 4)
    outs = eng.generate(kids, 12, GREEDY)
    solo = eng.generate([trunk], 12, GREEDY)[0]
    assert outs == [solo] * 4


def test_writes_into_a_child_never_change_parent_or_sibling_kv(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=128, block_size=4, debug=True)
    parent = eng.new_branch("parent", PROMPT)
    x, y = eng.fork(parent, names=["x", "y"])
    eng.generate([y], 2, SAMPLED)
    parent_kv, y_kv = branch_kv(eng, parent), branch_kv(eng, y)
    eng.generate([x], 11, SAMPLED)  # crosses several block boundaries, starting in the shared tail block
    eng.append(x, " and more text")
    assert torch.equal(branch_kv(eng, parent), parent_kv)
    assert torch.equal(branch_kv(eng, y), y_kv)
    x_kv = branch_kv(eng, x)
    eng.generate([y, parent], 6, SAMPLED)
    assert torch.equal(branch_kv(eng, x), x_kv)
    assert torch.equal(branch_kv(eng, y)[:, :, : y_kv.shape[2]], y_kv)
    eng.audit()


def test_fork_touches_no_block_and_prune_returns_the_pool(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4, debug=True)
    trunk = eng.new_branch("trunk", PROMPT)
    blocks_before, free_before = eng.block_table()["blocks"], eng.num_free_blocks
    kids = eng.fork(trunk, 100)
    assert eng.num_free_blocks == free_before
    assert [(b["id"], b["refcount"]) for b in eng.block_table()["blocks"]] == \
           [(b["id"], b["refcount"]) for b in blocks_before]
    assert all(k.tokens == trunk.tokens for k in kids)
    eng.generate(kids[:3], 5, SAMPLED)
    eng.prune(kids, trunk)
    assert eng.num_free_blocks == 64 and eng.tree()["branches"] == {}
    eng.audit()


def test_numbered_forks_skip_taken_names_and_count_past_any_cache(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    trunk = eng.new_branch("trunk", PROMPT)
    eng.fork(trunk, names=["trunk/1"])
    assert [k.name for k in eng.fork(trunk, 3)] == ["trunk/0", "trunk/2", "trunk/3"]
    many = eng.fork("trunk/0", 20_000)
    assert [k.name for k in many] == [f"trunk/0/{i}" for i in range(20_000)]
    assert [k.name for k in eng.fork(trunk, 2)] == ["trunk/4", "trunk/5"]
    eng.audit()


def test_a_second_numbered_fork_takes_the_lowest_free_indices_in_order(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=64, block_size=4)
    trunk = eng.new_branch("trunk", PROMPT)
    first = eng.fork(trunk, 1000)
    eng.prune(first[10], first[500], first[999])
    beyond = [f"trunk/{i}" for i in (*range(1000, 1010), 2001)]  # taken in the second and third 1,000 too
    eng.fork(trunk, names=beyond)
    second = eng.fork(trunk, 1000)
    taken = {b.name for b in first} - {"trunk/10", "trunk/500", "trunk/999"} | set(beyond)
    expected = [name for name in (f"trunk/{i}" for i in range(3000)) if name not in taken][:1000]
    assert [k.name for k in second] == expected
    assert expected[:4] == ["trunk/10", "trunk/500", "trunk/999", "trunk/1010"] and expected[-1] == "trunk/2007"
    eng.audit()
