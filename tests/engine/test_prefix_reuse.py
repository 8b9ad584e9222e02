"""Automatic prefix reuse (issue 41, item 1): a prompt's tokens the tree holds already are not prefilled again, a
branch built that way reads exactly what a fresh prefill would, the opt-in cache keeps what pruned branches held
until the pool needs it, rewind moves a branch back, and every such call is all or nothing."""
import re

import pytest

from dendrite_nb import EmptyBranch, Engine, OutOfBlocks, SamplingParams
from dendrite_nb.engine.prefill import PrefillReport
from tests.support.chat_checkpoints import CHAT_FAMILIES, write_chat_checkpoint
from tests.support.engines import engine_state, interrupt_forward_call, refused

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3 + (i * 37) % 240 for i in range(100)]   # 100 token ids of the tiny vocabulary, no two neighbours equal
OTHER = [3 + (i * 53 + 7) % 240 for i in range(100)]


def state(eng):
    """What a failed call must leave as it was: tree, block table, free blocks, cache, and the last report."""
    return (*engine_state(eng), eng.num_cached_blocks, eng.prefill_report, eng.prefill_totals)


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded = Engine.from_pretrained(checkpoint(), num_blocks=8)
    return loaded.model, loaded.tokenizer


@pytest.fixture
def eng(model):
    return Engine(model[0], model[1], num_blocks=96, block_size=4, debug=True)


@pytest.fixture
def fresh(model):
    """fresh(tokens) -> the next-token logits of a branch prefilled with `tokens` in a new, roomy engine."""
    def logits(tokens):
        reference = Engine(model[0], model[1], num_blocks=256, block_size=4)
        return reference.next_logits([reference.new_branch("x", tokens)])[0]
    return logits


def fresh_generation(model, tokens, steps=16):
    reference = Engine(model[0], model[1], num_blocks=256, block_size=4)
    return reference.generate([reference.new_branch("x", tokens)], steps, GREEDY)[0]


def assert_reads_like_a_fresh_prefill(eng, fresh, branch):
    assert (eng.next_logits([branch])[0] - fresh(branch.tokens)).abs().max().item() < 1e-4


# ---- reuse ----------------------------------------------------------------------------------------------
def test_the_same_prompt_again_prefills_nothing_or_only_its_last_token(eng, fresh):
    a = eng.new_branch("a", PROMPT)
    assert eng.prefill_report == PrefillReport(0, 100)
    free = eng.num_free_blocks
    b = eng.new_branch("b", PROMPT)   # a's node ends where the prompt does, with the state after it
    assert eng.prefill_report == PrefillReport(100, 0) and b.node is a.node and eng.num_free_blocks == free
    eng.prune(b)
    eng.generate([a], 4, GREEDY)   # a alone on its node again: it grows in place, past the prompt
    c = eng.new_branch("c", PROMPT)   # so the state after the prompt is not held: its last token is prefilled
    assert eng.prefill_report == PrefillReport(99, 1) and c.tokens == PROMPT
    assert eng.prefill_totals == PrefillReport(199, 101)
    assert_reads_like_a_fresh_prefill(eng, fresh, c)
    assert_reads_like_a_fresh_prefill(eng, fresh, a)
    eng.audit()


def test_a_prompt_sharing_40_of_100_tokens_prefills_60(eng, fresh):
    eng.new_branch("a", PROMPT)
    b = eng.new_branch("b", PROMPT[:40] + OTHER[:60])
    assert eng.prefill_report == PrefillReport(40, 60)
    assert_reads_like_a_fresh_prefill(eng, fresh, b)
    assert_reads_like_a_fresh_prefill(eng, fresh, eng.branch("a"))
    eng.audit()


@pytest.mark.parametrize("shared, copies", [(40, 0), (41, 1), (43, 1)])
def test_a_split_off_a_block_boundary_costs_one_block_copy(eng, fresh, shared, copies):
    eng.new_branch("a", PROMPT)
    free = eng.num_free_blocks
    b = eng.new_branch("b", PROMPT[:shared] + OTHER[:20])
    end = shared + 20
    own = -(-end // 4) - shared // 4   # b's new node: from the block holding its first token on
    assert eng.num_free_blocks == free - own - copies
    assert len({block for node in eng.tree()["nodes"] for block in node["blocks"]}) == 96 - eng.num_free_blocks
    assert_reads_like_a_fresh_prefill(eng, fresh, b)
    assert_reads_like_a_fresh_prefill(eng, fresh, eng.branch("a"))
    eng.audit()


def test_forks_linear_runs_and_reused_prefixes_read_the_same(eng, fresh):
    root = eng.new_branch("root", PROMPT[:30])
    x, y = eng.fork(root, n=2)
    eng.append(x, OTHER[:13])
    eng.append(y, OTHER[:5] + PROMPT[:9])   # reuses 5 of x's tokens: a split inside x's node
    eng.generate([x, y], 6, GREEDY)
    z = eng.new_branch("z", PROMPT[:30] + OTHER[:13])   # all of root, then x's node up to where x generated
    assert eng.prefill_report.reused_tokens == 42
    linear = eng.new_branch("linear", OTHER[:50])
    eng.append(linear, PROMPT[:7])
    for branch in (root, x, y, z, linear):
        assert_reads_like_a_fresh_prefill(eng, fresh, branch)
    eng.audit()


def test_generation_from_a_reused_prefix_equals_generation_from_a_fresh_one(eng, model):
    eng.new_branch("a", PROMPT[:50])
    eng.generate([eng.branch("a")], 8, GREEDY)
    b = eng.new_branch("b", PROMPT[:37] + OTHER[:3])
    assert eng.prefill_report == PrefillReport(37, 3)
    assert eng.generate([b], 16, GREEDY)[0] == fresh_generation(model, PROMPT[:37] + OTHER[:3])
    eng.audit()


def test_scoring_an_append_reuses_nothing(eng):
    eng.new_branch("a", PROMPT[:20])
    b = eng.new_branch("b")
    eng.append(b, PROMPT[:20], logprobs=True)
    assert eng.prefill_report == PrefillReport(0, 20) and all(lp is not None for lp in eng.logprobs(b)[1:])


def test_a_reused_scored_prefix_keeps_its_log_probabilities_and_nothing_else_is_scored(eng):
    # Found by tests/kv/test_stateful.py: a new branch over a scored prefix shares that prefix's nodes, and with
    # them the log-probabilities they keep. They are the values a scoring forward would give the new branch.
    a = eng.new_branch("a", PROMPT[:1])
    eng.append(a, PROMPT[1:12], logprobs=True)
    b = eng.new_branch("b", PROMPT[:12] + OTHER[:4])
    assert eng.prefill_report.reused_tokens >= 11
    assert eng.logprobs(b)[:12] == eng.logprobs(a) and eng.logprobs(b)[12:] == [None] * 4
    scored = eng.new_branch("scored")
    eng.append(scored, PROMPT[:12] + OTHER[:4], logprobs=True)
    assert eng.logprobs(b)[1:12] == pytest.approx(eng.logprobs(scored)[1:12], abs=1e-4)
    c = eng.new_branch("c", PROMPT[:6] + OTHER[:2])  # ends inside a's node: the split keeps each token's value
    assert eng.logprobs(c) == eng.logprobs(a)[:6] + [None] * 2 and eng.logprobs(a)[1:] == eng.logprobs(b)[1:12]
    eng.audit()


def test_with_prefix_reuse_off_every_prompt_is_prefilled(model):
    eng = Engine(model[0], model[1], num_blocks=96, block_size=4, prefix_reuse=False)
    assert eng.prefix_reuse is False
    eng.new_branch("a", PROMPT[:40])
    free = eng.num_free_blocks
    eng.new_branch("b", PROMPT[:40])
    assert eng.prefill_report == PrefillReport(0, 40) and eng.num_free_blocks == free - 10
    eng.prefix_reuse = True
    eng.new_branch("c", PROMPT[:40])
    assert eng.prefill_report.reused_tokens == 40
    with pytest.raises(ValueError, match="prefix_reuse must be True or False"):
        eng.prefix_reuse = "yes"


def test_a_write_reports_what_its_whole_call_prefilled(eng):
    eng.new_branch("a", PROMPT[:30])
    eng.write("b", PROMPT[:30] + OTHER[:4])   # new_branch, then append, inside one call
    assert eng.prefill_report == PrefillReport(30, 4)
    eng.fork("b", names=["c"])
    assert eng.prefill_report == PrefillReport(30, 4)   # a fork prefills nothing and reports nothing


# ---- the cache --------------------------------------------------------------------------------------------
def test_pruned_nodes_stay_cached_and_a_later_prompt_reuses_them(model, fresh):
    eng = Engine(model[0], model[1], num_blocks=96, block_size=4, prefix_cache=True, debug=True)
    eng.new_branch("a", PROMPT[:60])
    used = 96 - eng.num_free_blocks
    assert eng.prune("a") == 0 and eng.num_cached_blocks == used and eng.num_free_blocks == 96 - used
    assert [node["cached"] for node in eng.tree()["nodes"]] == [False, True] and eng.tree()["branches"] == {}
    eng.audit()
    b = eng.new_branch("b", PROMPT[:60] + OTHER[:4])
    assert eng.prefill_report == PrefillReport(60, 4) and eng.num_cached_blocks == 0
    assert_reads_like_a_fresh_prefill(eng, fresh, b)
    eng.audit()


def test_eviction_frees_the_least_recently_used_cached_nodes_and_never_a_live_branch(model, fresh):
    eng = Engine(model[0], model[1], num_blocks=40, block_size=4, prefix_cache=True, debug=True)
    live = eng.new_branch("live", OTHER[:40])   # 10 blocks
    for name, start in [("old", 0), ("mid", 20), ("new", 40)]:
        eng.new_branch(name, PROMPT[start:start + 40])   # 10 blocks each
        eng.prune(name)
    assert eng.num_free_blocks == 0 and eng.num_cached_blocks == 30
    eng.new_branch("again", PROMPT[:40])   # "old" used again: "mid" is now the least recently used
    eng.prune("again")
    eng.new_branch("big", OTHER[50:90])   # needs 10 blocks: "mid" makes way
    cached = [node["tokens"][:1] for node in eng.tree()["nodes"] if node["cached"]]
    assert sorted(cached) == sorted([PROMPT[:1], PROMPT[40:41]])
    assert eng.num_free_blocks + eng.num_cached_blocks == 40 - 20
    eng.generate([live, eng.branch("big")], 24, GREEDY)   # decode steps evict what they need, never a live node
    assert eng.num_cached_blocks < 20 and eng.num_free_blocks + eng.num_cached_blocks == 40 - 2 * 16
    assert_reads_like_a_fresh_prefill(eng, fresh, live)
    eng.audit()
    with pytest.raises(OutOfBlocks):
        eng.new_branch("too_big", [7] * 40)


def test_drop_cache_and_turning_the_cache_off_give_the_pool_back(model):
    eng = Engine(model[0], model[1], num_blocks=64, block_size=4, prefix_cache=True)
    eng.new_branch("a", PROMPT[:40])
    eng.new_branch("b", OTHER[:40])
    eng.prune("a")
    assert eng.drop_cache() == 10 and eng.num_cached_blocks == 0
    eng.prune("b")
    assert eng.num_cached_blocks == 10
    eng.prefix_cache = False
    assert eng.num_cached_blocks == 0 and eng.num_free_blocks == 64 and eng.tree()["nodes"][0]["children"] == []
    eng.new_branch("c", PROMPT[:40])
    eng.prune("c")   # the cache is off: collected at once
    assert eng.num_free_blocks == 64
    with pytest.raises(ValueError, match="prefix_cache must be True or False"):
        eng.prefix_cache = 1
    eng.audit()


def test_a_session_with_cached_nodes_saves_only_what_branches_reach(model, checkpoint, tmp_path):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4, prefix_cache=True)
    eng.new_branch("a", PROMPT[:40])
    b = eng.new_branch("b", PROMPT[:20] + OTHER[:10])
    eng.prune("a")
    assert eng.num_cached_blocks > 0
    again = Engine.restore(eng.save(tmp_path / "s.dendrite"))
    assert again.prefix_cache is True and again.num_cached_blocks == 0
    assert again.branch("b").tokens == b.tokens
    assert again.num_free_blocks == 96 - len(again.block_table()["blocks"])
    assert (again.next_logits(["b"]) - eng.next_logits([b])).abs().max().item() < 1e-4
    again.audit()
    c = again.new_branch("c", PROMPT[:20] + OTHER[:10])
    assert again.prefill_report == PrefillReport(30, 0) and c.node is again.branch("b").node
    assert Engine.restore(tmp_path / "s.dendrite", prefix_cache=False).prefix_cache is False   # a restore may change it


@pytest.mark.parametrize("option", ["prefix_reuse", "prefix_cache"])
def test_the_options_take_only_true_or_false(model, option):
    with pytest.raises(ValueError, match=f"{option} must be True or False, got 'yes'"):
        Engine(model[0], model[1], num_blocks=8, **{option: "yes"})


# ---- rewind ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", [False, True])
def test_rewind_then_append_prefills_only_from_the_first_changed_token(model, fresh, cache):
    eng = Engine(model[0], model[1], num_blocks=96, block_size=4, prefix_cache=cache, debug=True)
    a = eng.new_branch("a", PROMPT[:50])
    free = eng.num_free_blocks
    eng.rewind(a, 30)   # inside a's own node: cut in place, or split to keep the rest as cache
    assert len(a) == 30 and a.tokens == PROMPT[:30]
    assert eng.num_free_blocks == (free - 1 if cache else free + 5)   # a block copy, or the blocks past the cut
    with pytest.raises(EmptyBranch, match="rewound into a run of tokens"):   # no forward ran: nothing to decode from
        eng.next_logits([a])
    eng.append(a, OTHER[:10])
    assert eng.prefill_report == PrefillReport(0, 10) and a.tokens == PROMPT[:30] + OTHER[:10]
    assert_reads_like_a_fresh_prefill(eng, fresh, a)
    eng.rewind(a, 30)
    eng.append(a, PROMPT[30:50])   # the first text back: kept as cache only with prefix_cache on
    assert eng.prefill_report.reused_tokens == (20 if cache else 0)
    assert_reads_like_a_fresh_prefill(eng, fresh, a)
    assert eng.num_cached_blocks > 0 if cache else eng.num_cached_blocks == 0
    eng.audit()


def test_rewind_to_a_node_boundary_or_to_nothing(eng, model):
    a = eng.new_branch("a", PROMPT[:20])
    (b,) = eng.fork(a, names=["b"])
    eng.append(b, OTHER[:20])
    free = eng.num_free_blocks
    eng.rewind(b, 20)   # the end of a's node, whose state is known: b decodes from it; b's own node is freed
    assert b.node is a.node and eng.num_free_blocks == free + 5
    assert eng.generate([b], 16, GREEDY)[0] == fresh_generation(model, PROMPT[:20])
    eng.rewind(b, 0)
    assert len(b) == 0 and b.node is eng.branch_tree.root
    eng.append(b, PROMPT[:20])
    assert eng.prefill_report == PrefillReport(20, 0)
    eng.audit()


def test_rewind_works_the_grammar_position_out_again(checkpoint):
    eng = Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4)
    a = eng.new_branch("a", "Digits:")
    mark = len(a)
    eng.generate([a], 12, GREEDY, constraint={"regex": "[0-9]{8}"})
    assert a.matcher.is_stopped()
    kept = a.tokens[mark + 2]
    eng.rewind(a, mark + 2)   # the grammar is back after two tokens: it takes the third, and goes on to 8 digits
    eng.append(a, [kept])
    eng.generate([a], 12, GREEDY)
    assert re.fullmatch("[0-9]{8}", eng.decode(a.tokens[mark:], skip_end_tokens=True))
    eng.rewind(a, mark - 1)   # before the constraint was attached: it starts again at the cut
    assert a.constraint_from == mark - 1


def test_rewind_into_a_conversation_is_refused_and_to_zero_starts_it_again(checkpoint, tmp_path):
    folder = write_chat_checkpoint(checkpoint(CHAT_FAMILIES["llama3.1"][0]), tmp_path / "chat", "llama3.1")
    eng = Engine.from_pretrained(folder, num_blocks=64, block_size=4)
    a = eng.new_branch("a")
    eng.chat(a, "user", "Hi!")
    eng.generate([a], 3, GREEDY)
    eng.rewind(a, a.chat.mark + 1)   # into the reply: the conversation stays
    assert a.chat is not None
    refused(eng, lambda: eng.rewind(a, 3), ValueError, "would cut into its messages")
    eng.rewind(a, 0)
    assert a.chat is None and len(a) == 0


@pytest.mark.parametrize("bad", [-1, 101, 2.0, True, "3", None])
def test_a_bad_rewind_changes_nothing(eng, bad):
    a = eng.new_branch("a", PROMPT)
    refused(eng, lambda: eng.rewind(a, bad), (ValueError, TypeError), "num_tokens must be an int")


def test_rewind_of_a_preempted_branch(eng, fresh):
    a = eng.new_branch("a", PROMPT[:20])
    (b,) = eng.fork(a, names=["b"])
    eng.append(b, OTHER[:20])
    eng.preempt(b)
    eng.rewind(b, 30)   # inside its parked tokens: resumed first
    assert len(b) == 30 and not eng.tree()["nodes"][-1]["preempted"]
    eng.append(b, OTHER[10:12])
    assert_reads_like_a_fresh_prefill(eng, fresh, b)
    eng.preempt(b)
    eng.rewind(b, 10)   # before them: the parked node is dropped
    assert len(b) == 10 and not any(node["preempted"] for node in eng.tree()["nodes"])
    eng.append(b, [PROMPT[10]])
    assert_reads_like_a_fresh_prefill(eng, fresh, b)
    eng.audit()


# ---- all or nothing -------------------------------------------------------------------------------------
def test_out_of_blocks_after_a_split_changes_nothing(model):
    eng = Engine(model[0], model[1], num_blocks=16, block_size=4, debug=True)
    eng.new_branch("a", PROMPT[:40])   # 10 blocks of 16
    before = state(eng)
    with pytest.raises(OutOfBlocks):
        eng.new_branch("b", PROMPT[:22] + OTHER[:40])   # splits a's node, then cannot hold the rest
    assert state(eng) == before
    eng.audit()


@pytest.mark.parametrize("call", [1, 2])
def test_ctrl_c_in_a_call_that_split_changes_nothing(eng, monkeypatch, call):
    eng.new_branch("a", PROMPT[:40])
    eng.prefill_chunk_tokens = 8   # several forwards
    before = state(eng)
    interrupt_forward_call(monkeypatch, eng, call)
    with pytest.raises(KeyboardInterrupt):
        eng.new_branch("b", PROMPT[:22] + OTHER[:20])
    assert state(eng) == before
    monkeypatch.undo()
    eng.audit()
    eng.new_branch("b", PROMPT[:22] + OTHER[:20])
    assert eng.prefill_report == PrefillReport(22, 20)


@pytest.mark.parametrize("call", [1, 2])
def test_ctrl_c_in_a_call_that_evicted_puts_the_cache_back(model, monkeypatch, call):
    eng = Engine(model[0], model[1], num_blocks=24, block_size=4, prefix_cache=True, debug=True)
    eng.prefill_chunk_tokens = 8
    for name, start in [("x", 0), ("y", 40)]:
        eng.new_branch(name, PROMPT[start:start + 40])
        eng.prune(name)
    before = state(eng)
    assert eng.num_free_blocks == 4 and eng.num_cached_blocks == 20
    interrupt_forward_call(monkeypatch, eng, call)
    with pytest.raises(KeyboardInterrupt):
        eng.new_branch("z", OTHER[:40])   # needs 10 blocks: evicts before its first forward
    assert state(eng) == before
    monkeypatch.undo()
    eng.audit()


def test_a_rewind_that_finds_no_block_for_its_copy_changes_nothing(model):
    eng = Engine(model[0], model[1], num_blocks=16, block_size=4, debug=True)
    a = eng.new_branch("a", PROMPT[:40])
    (b,) = eng.fork(a, names=["b"])
    eng.append(b, OTHER[:24])   # the pool is full
    refused(eng, lambda: eng.rewind(b, 27), OutOfBlocks, "splitting a node")   # a's node, off a block boundary
    eng.rewind(b, 28)   # on a block boundary: no copy
    assert b.tokens == PROMPT[:28] and a.tokens == PROMPT[:40]
    eng.audit()
