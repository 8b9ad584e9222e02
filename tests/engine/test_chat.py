"""Engine.chat: one more message as the model's chat template writes it, so that a conversation built turn by turn
is token-identical to `tokenizer.apply_chat_template` on all of it, for SmolLM2's template (the real model's
GGUF: its tokenizer, template and weights), Llama 3.1's and Qwen2.5's (published templates on the tiny test checkpoints,
tests/support/chat_checkpoints.py). The real model prefills slowly on a CPU, so most engine tests use the tiny ones and
SmolLM2's template is checked turn by turn through the planner (ChatTemplate.plan, what chat() appends) and once
through the engine with generated replies."""
from collections.abc import Mapping
from pathlib import Path

import pytest

from dendrite_nb import ChatError, Engine, OutOfBlocks, SamplingParams
from dendrite_nb.chat import ChatState, ChatTemplate, template_roles
from dendrite_nb.testing import TINY_SHAPES
from dendrite_nb.testing.tokenizer import _FAMILIES

from tests.support.chat_checkpoints import CHAT_FAMILIES, write_chat_checkpoint
from tests.support.engines import engine_state

GREEDY = SamplingParams(temperature=0.0)
# The token each template writes to close a turn.
CLOSE = {"llama3.1": "<|eot_id|>", "qwen2.5": "<|im_end|>", "smollm2": "<|im_end|>"}
ROLES = {"llama3.1": {"system", "user", "assistant", "tool", "ipython"},
         "qwen2.5": {"system", "user", "assistant", "tool"},
         "smollm2": {"system", "user", "assistant", "tool"}}


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    written = {}

    def get(family: str) -> Path:
        if family not in written:
            written[family] = write_chat_checkpoint(checkpoint(CHAT_FAMILIES[family][0]),
                                                    tmp_path_factory.mktemp(family) / "checkpoint", family)
        return written[family]

    return get


@pytest.fixture(scope="module", params=["llama3.1", "qwen2.5"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def loaded(family, folders):
    return Engine.from_pretrained(folders(family), num_blocks=512, block_size=4, debug=True)


@pytest.fixture(scope="module")
def smollm2(demo_engine):
    return demo_engine(num_blocks=256)


@pytest.fixture(scope="module", params=["llama3.1", "qwen2.5", "smollm2"])
def tokenizer(request, folders):
    """(family, tokenizer): SmolLM2's is the one its GGUF gives the engine."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        return request.param, request.getfixturevalue("smollm2").tokenizer
    return request.param, AutoTokenizer.from_pretrained(folders(request.param))


@pytest.fixture
def eng(loaded):
    yield loaded
    loaded.prune(list(loaded.branches.values()))
    loaded.audit()


def reference(eng, conversation, generation_prompt):
    """The ids apply_chat_template gives for the whole conversation (transformers 5 returns a BatchEncoding)."""
    out = eng.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def rendered(tokenizer, conversation, generation_prompt):
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)


def encode(eng, text):
    return eng.tokenizer.encode(text, add_special_tokens=False)


def message(role, content):
    return {"role": role, "content": content}


def test_the_roles_each_template_knows(tokenizer):
    family, tokens = tokenizer
    assert template_roles(tokens.chat_template) == ROLES[family]


def test_roles_of_templates_that_name_only_some():
    # Mistral's format names only 'user' and writes every other message as the assistant's.
    assert template_roles(_FAMILIES["mistral"].chat_template) == {"user", "assistant"}
    checked = ("{% for m in messages %}{% if m['role'] not in ('user', 'bot') %}{{ raise_exception('no') }}"
               "{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert template_roles(checked) == {"user", "assistant", "bot"}


def test_the_stored_templates_write_the_published_format(folders):
    from transformers import AutoTokenizer

    conversation = [message("user", "Hello, how are you?"), message("assistant", "I'm doing great.")]
    llama = AutoTokenizer.from_pretrained(folders("llama3.1"))
    assert rendered(llama, conversation, True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello, how are you?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI'm doing great.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    qwen = AutoTokenizer.from_pretrained(folders("qwen2.5"))
    assert rendered(qwen, conversation, True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\nI'm doing great.<|im_end|>\n"
        "<|im_start|>assistant\n")


CONVERSATIONS = {
    "no system": [("user", "Hi! Who are you?", None), ("assistant", "A helper.", None),
                  ("user", "Name three colours.", None)],
    "system first": [("system", "You answer in one word.", None), ("user", "Capital of France?", None),
                     ("assistant", "Paris", None), ("user", "And of Italy?", None)],
    "two users, then an assistant with a prompt after it": [
        ("user", "First part.", False), ("user", "Second part.", True), ("assistant", "Both read.", True)],
}


@pytest.mark.parametrize("script", list(CONVERSATIONS))
def test_each_template_adds_exactly_its_tokens_for_one_more_message(tokenizer, script):
    """The planner alone, on each tokenizer (SmolLM2's real one included): what chat() appends turn by turn."""
    _, tokens = tokenizer
    # No reply reaches these conversations, so no end token is ever read as one's end.
    template, held, state, conversation = ChatTemplate(tokens, frozenset()), [], None, []
    for role, content, prompt in CONVERSATIONS[script]:
        with_prompt = role not in ("system", "assistant") if prompt is None else prompt
        planned = template.plan(state, held, role, content, with_prompt, "talk")
        held = held + planned.tokens
        state = ChatState(planned.messages, len(held), with_prompt)
        conversation.append(message(role, content))
        out = tokens.apply_chat_template(conversation, tokenize=True, add_generation_prompt=with_prompt)
        assert held == list(out["input_ids"] if isinstance(out, Mapping) else out), (script, role)


@pytest.mark.parametrize("script", list(CONVERSATIONS))
def test_a_conversation_built_turn_by_turn_equals_the_template_on_all_of_it(eng, script):
    branch = eng.new_branch("talk")
    conversation = []
    for role, content, prompt in CONVERSATIONS[script]:
        planned = eng.chat_tokens(branch, role, content, generation_prompt=prompt)
        before = engine_state(eng)
        assert eng.chat_tokens(branch, role, content, generation_prompt=prompt) == planned   # and changed nothing
        assert engine_state(eng) == before
        assert eng.chat(branch, role, content, generation_prompt=prompt) is branch
        conversation.append(message(role, content))
        with_prompt = role not in ("system", "assistant") if prompt is None else prompt
        assert branch.tokens == reference(eng, conversation, with_prompt), (script, role)
        assert branch.tokens[len(branch) - len(planned):] == planned
    assert branch.chat.messages == tuple((role, content) for role, content, _ in CONVERSATIONS[script])


@pytest.mark.parametrize("closed", [False, True], ids=["cut reply", "reply ending its turn"])
def test_an_appended_reply_becomes_the_assistant_message(eng, family, closed):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Tell me a story.")
    reply = encode(eng, "Once upon a time, a river.")
    eng.append(branch, reply + ([eng.tokenizer.convert_tokens_to_ids(CLOSE[family])] if closed else []))
    eng.chat(branch, "user", "Shorter, please.")
    conversation = [message("user", "Tell me a story."), message("assistant", "Once upon a time, a river."),
                    message("user", "Shorter, please.")]
    assert branch.tokens == reference(eng, conversation, True)
    assert branch.chat.messages[1] == ("assistant", "Once upon a time, a river.")


def test_a_generated_reply_becomes_the_assistant_message(eng, family):
    """The template's text of the conversation whose assistant content is the decoded reply; tokens identical
    to the template's outside the reply, whose own tokens stay as generated (random tiny weights draw ids
    that need not be what the reply's text tokenizes to; the real SmolLM2's do round-trip, see below)."""
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Tell me a story.")
    before = branch.tokens
    [reply] = eng.generate(branch, 8, GREEDY)
    content = eng.decode(reply, skip_end_tokens=True)
    if family == "llama3.1":   # its template trims messages (the test of a reply written otherwise covers that)
        assert content == content.strip()
    eng.chat(branch, "user", "Again?")
    conversation = [message("user", "Tell me a story."), message("assistant", content), message("user", "Again?")]
    assert branch.chat.messages[1] == ("assistant", content)
    assert eng.decode(branch.tokens) == rendered(eng.tokenizer, conversation, True)
    assert branch.tokens[:len(before) + len(reply)] == before + reply
    tail = branch.tokens[len(before) + len(reply):]
    assert tail == reference(eng, conversation, True)[-len(tail):]


def test_smollm2_replies_keep_a_conversation_token_identical_to_its_template(smollm2):
    eng = smollm2
    branch = eng.new_branch("talk")
    conversation = []
    for question in ("What is the capital of France?", "And of Germany?"):
        eng.chat(branch, "user", question)
        [reply] = eng.generate(branch, 24, GREEDY)
        assert reply[-1] in eng.eos_token_ids   # the model closed its turn itself
        conversation += [message("user", question), message("assistant", eng.decode(reply, skip_end_tokens=True))]
    eng.chat(branch, "user", "Thanks!")
    conversation.append(message("user", "Thanks!"))
    assert "Paris" in conversation[1]["content"] and "Berlin" in conversation[3]["content"]
    assert branch.tokens == reference(eng, conversation, True)


@pytest.mark.parametrize("closed", [False, True], ids=["cut reply", "reply ending its turn"])
def test_a_reply_the_template_writes_otherwise_keeps_its_tokens_and_the_turn_is_closed_once(eng, family, closed):
    """Llama 3's template trims a message; a reply with spaces around it stays as the model wrote it, and the next
    message follows as the template writes it after the reply's content."""
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Hi")
    before = branch.tokens
    close = eng.tokenizer.convert_tokens_to_ids(CLOSE[family])
    reply = encode(eng, " Hi there ") + ([close] if closed else [])
    eng.append(branch, reply)
    eng.chat(branch, "user", "Bye")
    conversation = [message("user", "Hi"), message("assistant", " Hi there "), message("user", "Bye")]
    written = "Hi there" if family == "llama3.1" else " Hi there "
    after = rendered(eng.tokenizer, conversation, True)[len(rendered(eng.tokenizer, conversation[:1], True)):]
    assert after.startswith(written + CLOSE[family])
    tail = after[len(written) + (len(CLOSE[family]) if closed else 0):]
    assert branch.tokens == before + reply + encode(eng, tail)
    assert branch.tokens.count(close) == 4   # the system turn's, "Hi"'s, the reply's (once), "Bye"'s


def test_a_prompt_before_the_first_message_stays_as_it_is(eng):
    branch = eng.new_branch("notes", "Notes: rivers are wide.")
    prompt = branch.tokens
    eng.chat(branch, "user", "Hi")
    first = reference(eng, [message("user", "Hi")], True)
    bos = eng.tokenizer.bos_token_id
    # A sequence-start BOS is written once, at the very start.
    assert branch.tokens == prompt + (first[1:] if prompt[:1] == first[:1] == [bos] else first)


def test_tokens_appended_after_a_closed_turn_stay_before_the_next_message(eng):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Question one.", generation_prompt=False)
    held = branch.tokens
    aside = encode(eng, " (an aside)")
    eng.append(branch, aside)
    eng.chat(branch, "user", "Question two.")
    one = [message("user", "Question one.")]
    two = one + [message("user", "Question two.")]
    added = rendered(eng.tokenizer, two, True)[len(rendered(eng.tokenizer, one, False)):]
    assert branch.tokens == held + aside + encode(eng, added)


def test_forks_of_a_conversation_share_the_kv_of_every_earlier_turn(eng, monkeypatch):
    # Each fork's message prefilled on its own, so that its node hangs off the trunk's: prefix reuse would also share
    # the header the two messages start with (tests/engine/test_prefix_reuse.py).
    monkeypatch.setattr(eng, "prefix_reuse", False)
    trunk = eng.new_branch("trunk")
    eng.chat(trunk, "user", "Pick a colour.")
    eng.chat(trunk, "assistant", "Blue.")
    free = eng.num_free_blocks
    kids = eng.fork(trunk, names=["trunk/0", "trunk/1"])
    assert eng.num_free_blocks == free and all(kid.chat is trunk.chat for kid in kids)   # a pointer each
    questions = ["Why blue?", "Name another one."]
    for kid, question in zip(kids, questions):
        eng.chat(kid, "user", question)
    size = eng.pool.block_size
    tables = eng.block_table()["branches"]
    shared = len(trunk) // size   # the full blocks; a partial last block is copied on write
    for kid, question in zip(kids, questions):
        conversation = [message("user", "Pick a colour."), message("assistant", "Blue."), message("user", question)]
        assert kid.tokens == reference(eng, conversation, True)
        assert kid.node.parent is trunk.node
        assert tables[kid.name][:shared] == tables["trunk"][:shared]
        assert kid.chat.messages[:2] == trunk.chat.messages
    grown = sum(-(-len(kid) // size) - shared for kid in kids)
    assert free - eng.num_free_blocks == grown


def test_text_leaves_out_end_tokens_which_the_ids_keep(eng):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Hi")
    eng.chat(branch, "assistant", "Hello.")
    ends = eng.eos_token_ids
    held = [t for t in branch.tokens if t in ends]
    assert held   # every turn closes with one
    text = eng.text(branch)
    assert text == eng.tokenizer.decode([t for t in branch.tokens if t not in ends])
    assert text == eng.decode(branch.tokens, skip_end_tokens=True)
    for name in eng.tokenizer.convert_ids_to_tokens(sorted(ends)):
        assert name not in text
    assert eng.tokenizer.convert_ids_to_tokens(held[0]) in eng.decode(branch.tokens)   # decode writes every id
    assert "Hello." in text


BAD = [
    ("narrator", "hi", {}, ChatError, r"does not know the role 'narrator'; it accepts .*'assistant'.*'user'"),
    ("", "hi", {}, ChatError, r"the role ''"),
    ("User", "hi", {}, ChatError, r"the role 'User'"),
    (3, "hi", {}, TypeError, r"role is a str"),
    ("user", 5, {}, TypeError, r"content is a str, got int"),
    ("user", None, {}, TypeError, r"content is a str, got NoneType"),
    ("user", "hi", {"generation_prompt": "yes"}, ValueError, r"generation_prompt must be True, False or None"),
]


@pytest.mark.parametrize("role, content, options, error, match", BAD, ids=[repr(b[:2]) for b in BAD])
def test_bad_input_changes_nothing(eng, role, content, options, error, match):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Hi", generation_prompt=False)
    state, chat = engine_state(eng), branch.chat
    with pytest.raises(error, match=match):
        eng.chat(branch, role, content, **options)
    assert engine_state(eng) == state and branch.chat is chat
    eng.audit()


def test_a_second_message_before_the_reply_is_refused(eng):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Hi")
    state, chat = engine_state(eng), branch.chat
    with pytest.raises(ChatError, match="generation prompt and no reply yet; generate the reply"):
        eng.chat(branch, "user", "Hello?")
    assert engine_state(eng) == state and branch.chat is chat
    eng.chat(branch, "assistant", "Hello!")   # giving the reply is the way on
    assert branch.tokens == reference(eng, [message("user", "Hi"), message("assistant", "Hello!")], False)


def test_a_template_that_refuses_the_conversation_is_a_clear_error(eng, monkeypatch):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Hi", generation_prompt=False)
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    monkeypatch.setattr(eng.tokenizer, "chat_template", strict)
    state, chat = engine_state(eng), branch.chat
    with pytest.raises(ChatError, match="refuses this conversation .*must alternate.*roles in order: user, user"):
        eng.chat(branch, "user", "Hi again")
    assert engine_state(eng) == state and branch.chat is chat


def test_an_engine_without_a_chat_template_says_so(eng, monkeypatch):
    branch = eng.new_branch("talk", "Plain text.")
    monkeypatch.setattr(eng.tokenizer, "chat_template", None)
    state = engine_state(eng)
    with pytest.raises(ChatError, match="a tokenizer without a chat template.*append text you format yourself"):
        eng.chat(branch, "user", "Hi")
    assert engine_state(eng) == state and branch.chat is None


def test_random_weights_have_no_template():
    shape = TINY_SHAPES["llama-gqa-untied"]
    eng = Engine.from_random(shape.hf_config(vocab_size=300), num_blocks=16, block_size=4)
    branch = eng.new_branch("ids", [1, 2, 3])
    with pytest.raises(ChatError, match="no tokenizer"):
        eng.chat(branch, "user", "Hi")
    assert branch.tokens == [1, 2, 3] and branch.chat is None


def test_a_refused_append_leaves_the_conversation_as_it_was(folders):
    eng = Engine.from_pretrained(folders("llama3.1"), num_blocks=6, block_size=4)
    branch = eng.new_branch("talk")
    state = engine_state(eng)
    with pytest.raises(OutOfBlocks):   # Llama 3.1's system header alone needs more than 6 blocks of 4
        eng.chat(branch, "user", "Hi")
    assert engine_state(eng) == state and branch.chat is None
    eng.audit()


def test_ctrl_c_during_a_chat_append_lands_after_the_message_and_its_state(eng, monkeypatch, sigint_raises):
    """A real SIGINT that arrives while chat() appends is raised once the tokens and the conversation state are
    both in place, so the next message sees the conversation as the branch holds it."""
    import os
    import signal

    branch = eng.new_branch("talk")
    expected = eng.chat_tokens(branch, "user", "Hi")
    append = eng.append

    def append_then_interrupt(*args, **kwargs):
        result = append(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)   # delivered at once, between the append and the state update
        return result

    monkeypatch.setattr(eng, "append", append_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        eng.chat(branch, "user", "Hi")
    assert branch.tokens == expected and branch.chat.mark == len(branch) and branch.chat.generation_prompt
    monkeypatch.undo()
    eng.append(branch, encode(eng, "Hello."))
    eng.chat(branch, "user", "Bye")
    assert branch.chat.messages[-2:] == (("assistant", "Hello."), ("user", "Bye"))
    eng.audit()


def test_save_and_restore_keep_the_conversation(eng, tmp_path):
    branch = eng.new_branch("talk")
    eng.chat(branch, "user", "Hi")
    eng.append(branch, encode(eng, "Hello there."))
    restored = Engine.restore(eng.save(tmp_path / "chat.dendrite"))
    assert restored.branch("talk").chat == branch.chat
    eng.chat(branch, "user", "Bye")
    restored.chat("talk", "user", "Bye")
    assert restored.branch("talk").tokens == branch.tokens
    assert restored.branch("talk").chat == branch.chat


# ---- chat_many: a whole conversation in one prefill -------------------------------------------------------------
CONVERSATION = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello! How can I help?"),
                ("user", "What is 2+2?")]


def test_chat_many_adds_what_chat_adds_message_by_message(eng):
    one_by_one = eng.new_branch("one")
    for position, (role, content) in enumerate(CONVERSATION):
        eng.chat(one_by_one, role, content, generation_prompt=None if position == len(CONVERSATION) - 1 else False)
    together = eng.chat_many(eng.new_branch("together"), CONVERSATION)
    assert together.tokens == one_by_one.tokens
    assert together.tokens == reference(eng, [message(r, c) for r, c in CONVERSATION], True)
    assert together.chat == one_by_one.chat
    reply = eng.generate([together], 6, GREEDY)[0]   # the reply joins the conversation, as after chat()
    eng.chat(together, "user", "Thanks.")
    assert together.chat.messages[-2] == ("assistant", eng.decode(
        [t for t in reply if t not in eng.eos_token_ids]))


def test_chat_many_refused_changes_nothing(eng):
    eng.chat_many(eng.new_branch("c"), CONVERSATION[:2])
    before = (eng.tree(), eng.block_table(), eng.num_free_blocks, eng.branch("c").chat)
    with pytest.raises(ChatError, match="generation prompt"):   # a user message with no reply before it
        eng.chat_many("c", [("user", "Again?"), ("user", "And again?")])
    with pytest.raises(ValueError, match="a \\(role, content\\) pair"):
        eng.chat_many("c", ["user: hi"])
    with pytest.raises(ValueError, match="non-empty"):
        eng.chat_many("c", [])
    assert (eng.tree(), eng.block_table(), eng.num_free_blocks, eng.branch("c").chat) == before
