"""`%%branch NAME --chat [--role R]`: the cell is one more chat message, as Engine.chat writes it, with the other
%%branch options (--from, --gen, sampling), driven through a real IPython shell."""
import pytest
from IPython.core.error import UsageError

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.magics import current_engine

from tests.support.chat_checkpoints import write_chat_checkpoint
from tests.support.engines import engine_state
from tests.support.notebook_session import install_in_session, magic

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def folder(checkpoint, tmp_path_factory):
    return write_chat_checkpoint(checkpoint("qwen2-gqa-tied"), tmp_path_factory.mktemp("qwen2.5") / "checkpoint",
                                 "qwen2.5")


@pytest.fixture
def ip(shell, folder):
    """The shell with a fresh engine on a tiny checkpoint carrying Qwen2.5's published chat template."""
    install_in_session(Engine.from_pretrained(folder, num_blocks=256, block_size=4, debug=True))
    return shell


def reference(conversation, generation_prompt=True):
    out = current_engine().tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
    return list(out["input_ids"])


def test_chat_cells_build_the_conversation_turn_by_turn(ip):
    created, _ = magic(ip, "branch talk --chat --role system", "You answer briefly.\n")
    assert created.action == "created talk"
    generated, _ = magic(ip, "branch talk --chat --gen 6 -t 0", "Name a river.")
    engine = current_engine()
    [reply] = generated.tokens
    conversation = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a river."}]
    branch = engine.branch("talk")
    assert branch.tokens == reference(conversation) + list(reply)
    assert generated["talk"] == engine.decode(reply, skip_end_tokens=True)

    magic(ip, "branch talk --chat", "Thanks.")
    conversation += [{"role": "assistant", "content": engine.decode(reply, skip_end_tokens=True)},
                     {"role": "user", "content": "Thanks."}]
    assert engine.decode(branch.tokens) == engine.tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    assert branch.chat.messages[-2] == ("assistant", engine.decode(reply, skip_end_tokens=True))


def test_a_chat_cell_from_a_fork_shares_the_earlier_turns_and_generates_like_the_python_api(ip, folder):
    magic(ip, "branch q --chat --role system", "Be brief.")
    magic(ip, "branch q --chat", "Pick a colour.")
    magic(ip, "branch q --chat --role assistant", "Blue.")
    generated, _ = magic(ip, "branch q/why --from q --chat --gen 5 -t 0", "Why?")
    engine = current_engine()
    assert engine.branch("q/why").node.parent is engine.branch("q").node

    reference_engine = Engine.from_pretrained(folder, num_blocks=256, block_size=4)
    q = reference_engine.new_branch("q")
    reference_engine.chat(q, "system", "Be brief.")
    reference_engine.chat(q, "user", "Pick a colour.")
    reference_engine.chat(q, "assistant", "Blue.")
    why = reference_engine.fork(q, names=["q/why"])[0]
    reference_engine.chat(why, "user", "Why?")
    expected = reference_engine.generate([why], 5, GREEDY)
    assert [list(t) for t in generated.tokens] == expected
    assert engine.branch("q/why").tokens == why.tokens


def test_a_first_chat_cell_is_the_whole_template_for_one_message(ip):
    magic(ip, "branch one --chat", "Hello")
    assert current_engine().branch("one").tokens == reference([{"role": "user", "content": "Hello"}])


@pytest.mark.parametrize("line, cell, match", [
    ("branch talk --chat --role narrator", "Once upon a time", r"does not know the role 'narrator'; it accepts"),
    ("branch talk --chat --role ''", "Hi", r"does not know the role ''"),
    ("branch talk --role system", "Hi", r"--role system is a chat message's role; add --chat"),
    ("branch talk --chat", "Hello again?", r"generation prompt and no reply yet"),
    ("branch fresh --chat --role narrator", "Hi", r"the role 'narrator'"),
    ("branch fresh --from talk --chat --role User", "Hi", r"the role 'User'"),
])
def test_a_refused_chat_cell_changes_nothing(ip, line, cell, match):
    magic(ip, "branch talk --chat", "Hi")
    engine = current_engine()
    state, chat = engine_state(engine), engine.branch("talk").chat
    with pytest.raises(UsageError, match=match):
        magic(ip, line, cell)
    assert engine_state(engine) == state and engine.branch("talk").chat is chat
    assert "fresh" not in engine.branches
    engine.audit()


def test_a_chat_cell_that_cannot_fit_its_generation_changes_nothing(ip):
    magic(ip, "branch talk --chat --role assistant", "Hello.")
    engine = current_engine()
    state = engine_state(engine)
    with pytest.raises(UsageError, match="OutOfBlocks"):   # 256 blocks of 4 hold 1,024 tokens
        magic(ip, "branch talk --chat --gen 1500", "Tell me everything.")
    assert engine_state(engine) == state


def test_the_docstring_shows_chat_cells(shell):  # noqa: F811
    doc = shell.find_cell_magic("branch").__doc__
    assert "--chat" in doc and "--role" in doc and "%%branch chat --chat --gen" in doc
