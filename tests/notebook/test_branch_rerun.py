"""Re-running a `%%branch` cell (issue 41): the same text is a no-op that says so, edited text prefills only from
its first changed token, a --gen cell's generation is replaced, a branch changed since gets the text appended, and
a re-run that fails or is interrupted leaves the branch as it was. Driven through IPython's shell, with the cell id
JupyterLab sends in the execute request's metadata."""
import pytest
import torch
from IPython.core.error import UsageError

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.magics import current_engine

from tests.support.chat_checkpoints import write_chat_checkpoint
from tests.support.engines import engine_state, interrupt_forward_call
from tests.support.notebook_session import FakeKernel, install_in_session, magic

OLD = "A river blocks the road. The first way across is to swim."
NEW = "A river blocks the road. The best way across is a boat."
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture
def ip(shell, checkpoint, monkeypatch):
    """The shell with a fresh engine, running cells as cell 'c1' of a JupyterLab notebook."""
    install_in_session(Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4, debug=True))
    in_cell(shell, monkeypatch, "c1")
    return shell


def in_cell(ip, monkeypatch, cell_id):
    metadata = {"cellId": cell_id} if cell_id is not None else {}
    monkeypatch.setattr(ip, "kernel", FakeKernel(metadata), raising=False)


def fresh(checkpoint, text, generate=0):
    """The branch as a new kernel would make it from `text` (then `generate` greedy tokens): tokens, next logits."""
    engine = Engine.from_pretrained(checkpoint(), num_blocks=96, block_size=4)
    branch = engine.new_branch("root", text)
    if generate:
        engine.generate([branch], generate, GREEDY)
    return branch.tokens, engine.next_logits([branch])[0]


def common_prefix(a, b):
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def test_the_same_text_again_is_a_no_op_that_says_so(ip):
    magic(ip, "branch root", OLD)
    engine = current_engine()
    before = engine_state(engine)
    again, _ = magic(ip, "branch root", OLD)
    assert repr(again).startswith("root unchanged, the cell's text is already there")
    assert engine_state(engine) == before


def test_edited_text_prefills_only_from_its_first_changed_token(ip, checkpoint):
    magic(ip, "branch root", OLD)
    engine = current_engine()
    old_tokens = engine.branch("root").tokens
    new_tokens = engine.encode(NEW, at_start=True)
    same = common_prefix(old_tokens, new_tokens)
    assert 0 < same < len(new_tokens)

    rewritten, _ = magic(ip, "branch root", NEW)
    changed = len(new_tokens) - same
    assert (rewritten.reused_tokens, rewritten.prefilled_tokens) == (same, changed)
    assert (engine.prefill_report.reused_tokens, engine.prefill_report.prefilled_tokens) == (same, changed)
    assert (f"rewrote root from the cell's first changed token (reused {same} tokens, prefilled {changed})"
            in repr(rewritten))
    tokens, logits = fresh(checkpoint, NEW)
    assert engine.branch("root").tokens == tokens == new_tokens
    torch.testing.assert_close(engine.next_logits(["root"])[0], logits)   # the reused KV is the new text's
    assert sorted(engine.branches) == ["root"]
    engine.audit()


def test_a_gen_cell_run_again_replaces_its_generation(ip, checkpoint):
    first, _ = magic(ip, "branch root --gen 6 -t 0 --ignore-eos", OLD)
    engine = current_engine()
    after_first = engine.branch("root").tokens
    again, _ = magic(ip, "branch root --gen 6 -t 0 --ignore-eos", OLD)
    assert engine.branch("root").tokens == after_first   # greedy: the same generation again, not a second one
    assert again.tokens == first.tokens
    assert repr(again).startswith("root: the cell's text is there already (reused ")
    assert "its earlier generation (6 tokens) is replaced" in repr(again)

    edited, _ = magic(ip, "branch root --gen 6 -t 0 --ignore-eos", NEW)
    tokens, logits = fresh(checkpoint, NEW, generate=6)
    assert engine.branch("root").tokens == tokens
    torch.testing.assert_close(engine.next_logits(["root"])[0], logits)
    assert edited.note.startswith("rewrote root from the cell's first changed token")
    engine.audit()


def test_a_branch_changed_since_the_cell_gets_the_text_appended(ip):
    magic(ip, "branch root", OLD)
    magic(ip, "gen root -n 3 --ignore-eos")
    appended, _ = magic(ip, "branch root", OLD)
    assert appended.action == "appended to root"
    assert current_engine().text("root").count(OLD) == 2


def test_another_cell_with_the_same_line_appends(ip, monkeypatch):
    magic(ip, "branch root", OLD)
    in_cell(ip, monkeypatch, "c2")
    appended, _ = magic(ip, "branch root", " More.")
    assert appended.action == "appended to root"
    assert current_engine().text("root").endswith(OLD + " More.")


def test_without_a_cell_id_only_the_same_line_and_text_is_a_re_run(ip, monkeypatch):
    in_cell(ip, monkeypatch, None)   # a terminal IPython: the next cell cannot be told from an edited one
    magic(ip, "branch root", OLD)
    again, _ = magic(ip, "branch root", OLD)
    assert again.action == "root unchanged, the cell's text is already there"
    appended, _ = magic(ip, "branch root", " More.")
    assert appended.action == "appended to root"
    assert current_engine().text("root").endswith(OLD + " More.")


def test_a_fork_cell_run_again_rewrites_the_fork_while_its_parent_is_unchanged(ip):
    magic(ip, "branch root", OLD)
    magic(ip, "branch kid --from root", " Then walk on.")
    engine = current_engine()
    rewritten, _ = magic(ip, "branch kid --from root", " Then run on.")
    assert rewritten.action.startswith("rewrote kid from the cell's first changed token")
    assert engine.text("kid") == engine.text("root") + " Then run on."
    magic(ip, "gen root -n 2 --ignore-eos")   # the parent moved on: the cell would fork anew, under a taken name
    with pytest.raises(UsageError, match="already exists"):
        magic(ip, "branch kid --from root", " Then fly.")
    engine.audit()


def test_a_re_run_that_cannot_fit_is_refused_before_anything_changes(ip):
    magic(ip, "branch root --gen 4 -t 0 --ignore-eos", OLD)
    engine = current_engine()
    before = engine_state(engine)
    with pytest.raises(UsageError, match="needs up to .* free KV blocks"):
        magic(ip, "branch root --gen 1000", NEW)
    with pytest.raises(UsageError, match="the model's context holds"):
        magic(ip, "branch root --gen 5000", NEW)
    assert engine_state(engine) == before


def test_ctrl_c_in_the_middle_of_a_re_run_puts_the_branch_back(ip):
    magic(ip, "branch root --gen 4 -t 0 --ignore-eos", OLD)
    engine = current_engine()
    tokens, logits = engine.branch("root").tokens, engine.next_logits(["root"])[0]
    before = engine_state(engine)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        interrupt_forward_call(patch, engine, 1)   # Ctrl-C in the rewrite's prefill
        magic(ip, "branch root --gen 4 -t 0 --ignore-eos", NEW)
    assert engine_state(engine) == before   # rewind and write are one call: undone together, block for block
    torch.testing.assert_close(engine.next_logits(["root"])[0], logits)
    engine.audit()
    again, _ = magic(ip, "branch root --gen 4 -t 0 --ignore-eos", OLD)   # still the cell's branch: a re-run
    assert engine.branch("root").tokens == tokens and "is replaced" in repr(again)


def test_a_chat_cell_run_again(shell, checkpoint, tmp_path, monkeypatch):
    """The first message of a conversation is rewritten in place; a later one cannot be (a conversation goes back
    only to the end of a message), so its edited text is added again, and the result says why."""
    folder = write_chat_checkpoint(checkpoint("qwen2-gqa-tied"), tmp_path / "chat", "qwen2.5")
    install_in_session(Engine.from_pretrained(folder, num_blocks=256, block_size=4, debug=True))
    in_cell(shell, monkeypatch, "system")
    magic(shell, "branch talk --chat --role system", "You answer briefly.")
    rewritten, _ = magic(shell, "branch talk --chat --role system", "You answer in one word.")
    engine = current_engine()
    assert rewritten.action.startswith("rewrote talk")
    assert engine.branch("talk").chat.messages == (("system", "You answer in one word."),)

    in_cell(shell, monkeypatch, "question")
    magic(shell, "branch talk --chat --gen 3 -t 0", "Name a river.")
    length = len(engine.branch("talk"))
    again, _ = magic(shell, "branch talk --chat --gen 3 -t 0", "Name a lake.")
    assert "a conversation goes back only to the end of a message: its text was added again" in again.note
    assert len(engine.branch("talk")) > length
    assert [m for m in engine.branch("talk").chat.messages if m[0] == "user"][-2:] == [
        ("user", "Name a river."), ("user", "Name a lake.")]
    engine.audit()


def test_a_chat_fork_cell_run_again_makes_its_fork_again(shell, checkpoint, tmp_path, monkeypatch):
    """`%%branch chat/de --from chat --chat` after a --gen cell: the fork's start cannot be rewound to (closing the
    parent's reply put tokens there), so the re-run forks the parent again; the parent stays as it was, the
    fork ends as a first run would leave it, and a re-run that fails changes nothing."""
    folder = write_chat_checkpoint(checkpoint("qwen2-gqa-tied"), tmp_path / "chat", "qwen2.5")
    install_in_session(Engine.from_pretrained(folder, num_blocks=256, block_size=4, debug=True))
    engine = current_engine()
    in_cell(shell, monkeypatch, "ask")
    magic(shell, "branch chat --chat --gen 3 -t 0 --ignore-eos", "Name a river.")
    parent = engine.branch("chat").tokens
    in_cell(shell, monkeypatch, "fork")
    magic(shell, "branch chat/de --from chat --chat", "And a lake?")
    first = engine.branch("chat/de").tokens
    again, _ = magic(shell, "branch chat/de --from chat --chat", "And a lake?")
    assert engine.branch("chat/de").tokens == first and engine.branch("chat").tokens == parent
    assert "already" in again.action
    edited, _ = magic(shell, "branch chat/de --from chat --chat", "And a sea?")
    assert edited.action.startswith("rewrote chat/de")
    assert engine.branch("chat/de").chat.messages[-1] == ("user", "And a sea?")
    assert engine.branch("chat/de").tokens[:len(parent)] == parent
    edited_length = len(engine.branch("chat/de"))
    engine.audit()
    before = engine_state(engine)
    with pytest.raises(UsageError, match="role"):
        magic(shell, "branch chat/de --from chat --chat --role wizard", "And a sea?")
    assert engine_state(engine) == before
    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        interrupt_forward_call(patch, engine, 1)   # Ctrl-C in the new fork's prefill, after the old fork was pruned
        magic(shell, "branch chat/de --from chat --chat", "And an ocean?")
    assert engine_state(engine) == before and engine.branch("chat/de").chat.messages[-1] == ("user", "And a sea?")
    engine.audit()
    magic(shell, "branch chat/de --from chat --chat --gen 2 -t 0 --ignore-eos", "And a sea?")
    messages = engine.branch("chat/de").chat.messages
    assert [m for m in messages if m[0] == "user"] == [("user", "Name a river."), ("user", "And a sea?")]   # once
    assert len(engine.branch("chat/de")) == edited_length + 2
    engine.audit()
