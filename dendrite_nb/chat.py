"""Chat turn by turn: the tokens that a model's chat template adds for one more message on a branch.

A branch that chat() built keeps its conversation (a ChatState): the messages so far, the branch length right
after the last chat call (the mark) and whether that call ended with the assistant's generation prompt. Tokens
that reach the branch after a generation prompt (generated, or appended) are the assistant's reply: its text,
without end-of-turn / end-of-text tokens, becomes an assistant message before the next one is added.

The tokens for a new message come from text: the template renders the conversation as the branch holds it and
the conversation with the new message; the second starts with the first, and what follows is tokenized without
added special tokens, which is what `tokenizer.apply_chat_template(tokenize=True)` does for the whole
conversation. So a conversation built turn by turn is token-identical to the template applied to all of it,
wherever the branch's own tokens are the ones the template's text tokenizes to (always, for messages chat()
added; for a generated reply, when its text re-tokenizes to the same ids).

When the template writes an earlier turn otherwise than the branch holds it (Llama 3's `| trim` of a reply
that ended in spaces, Qwen3 dropping the reasoning of earlier turns), the earlier turns stay as they are in the
KV cache and the new message is appended as the template writes it after them: for a reply, the text after the
reply's content in a rendering where a marker stands for that content (so the turn is closed the template's
way); otherwise, the rendering with the new message minus the rendering without it. If neither applies, chat
raises ChatError and nothing changes.

A branch that holds tokens chat() did not add (a prompt, few-shot text) keeps them as an opaque preamble: the
conversation starts after them as the template starts one (its default system prompt included), without a
second sequence-start BOS.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, NamedTuple

from .errors import ChatError

STANDARD_ROLES = ("system", "user", "assistant", "tool")
# Every chat template renders these (a template may name only "user" and write everything else as the assistant).
ALWAYS_KNOWN = frozenset(("user", "assistant"))
# Stands for a reply's content while the template closes its turn: letters only, so that `| trim`, `split()` and
# escaping leave it whole.
REPLY_MARKER = "DendriteReplyMarker7f3c"
# By default a message opens the assistant's turn after it, unless the assistant would not answer it: a system
# prompt is followed by the user's first message, and an assistant message is itself the answer.
NO_PROMPT_AFTER = ("system", "assistant")

Message = tuple[str, str]  # (role, content)


class ChatState(NamedTuple):
    """A branch's conversation, immutable: a fork shares it, and chat() replaces it."""
    messages: tuple[Message, ...]  # oldest first; a reply joins them when the next message is added
    mark: int                      # the branch length right after the last chat call
    generation_prompt: bool        # that call ended with the assistant's generation prompt


class PlannedMessage(NamedTuple):
    """What chat() will append, computed before anything changes."""
    tokens: list[int]              # the ids to append
    messages: tuple[Message, ...]  # the conversation once they are appended (ChatState.messages)


@lru_cache(maxsize=16)
def template_roles(source: str) -> frozenset[str]:
    """The roles a chat template knows: those its source compares a message's role with, the standard roles
    (system, user, assistant, tool) if it writes a message's role into the text, and always user and assistant."""
    from jinja2 import Environment, nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        """transformers' `{% generation %}` marks assistant text for training masks; to read roles, a plain block."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True))

    tree = Environment(extensions=["jinja2.ext.loopcontrols", GenerationBlock]).parse(source)

    def is_role(node: Any) -> bool:   # message.role, message['role'], messages[0]['role']
        return ((isinstance(node, nodes.Getattr) and node.attr == "role")
                or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "role"))

    def strings(node: Any) -> list[str]:
        items = node.items if isinstance(node, (nodes.Tuple, nodes.List)) else [node]
        return [item.value for item in items if isinstance(item, nodes.Const) and isinstance(item.value, str)]

    named: set[str] = set()
    compared: set[int] = set()
    for compare in tree.find_all(nodes.Compare):
        operands = [compare.expr, *(operand.expr for operand in compare.ops)]
        roles = [operand for operand in operands if is_role(operand)]
        if roles:
            compared.update(map(id, roles))
            named.update(text for operand in operands for text in strings(operand))
    writes_role = any(is_role(node) and id(node) not in compared
                      for node in tree.find_all((nodes.Getattr, nodes.Getitem)))
    return frozenset(named) | ALWAYS_KNOWN | (frozenset(STANDARD_ROLES) if writes_role else frozenset())


class ChatTemplate:
    """A tokenizer's chat template, rendered and tokenized as `apply_chat_template(tokenize=True)` does."""

    def __init__(self, tokenizer: Any, end_token_ids: frozenset[int],
                 check_text: Callable[[str], None] | None = None):
        """check_text(text) runs before each text to append is tokenized, and raises to refuse it (the engine's
        refuses text that cannot fit the branch, which a 5 MB message would otherwise take seconds to find)."""
        from jinja2 import TemplateError

        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            what = ("no tokenizer (built from random weights)" if tokenizer is None
                    else "a tokenizer without a chat template")
            raise ChatError(f"this engine has {what}, so it cannot write chat messages; load a checkpoint whose "
                            f"tokenizer has one (tokenizer_config.json's chat_template, or a GGUF's "
                            f"tokenizer.chat_template), or append text you format yourself with append().")
        if not isinstance(tokenizer.chat_template, str):
            raise ChatError("this tokenizer has several named chat templates; chat() needs a single default one.")
        self.tokenizer, self.end_token_ids, self.check_text = tokenizer, end_token_ids, check_text
        try:
            self.roles = template_roles(tokenizer.chat_template)
        except TemplateError as error:
            raise ChatError(f"the model's chat template is not valid Jinja ({error}); fix the tokenizer's "
                            f"chat_template, or append text you format yourself with append().") from None

    def check(self, role: Any, content: Any, generation_prompt: Any) -> None:
        if not isinstance(role, str):
            raise TypeError(f"a chat role is a str such as 'user', got {type(role).__name__}.")
        if role not in self.roles:
            raise ChatError(f"this model's chat template does not know the role {role!r}; it accepts "
                            f"{', '.join(map(repr, sorted(self.roles)))}.")
        if not isinstance(content, str):
            raise TypeError(f"a chat message's content is a str, got {type(content).__name__}.")
        if generation_prompt is not None and not isinstance(generation_prompt, bool):
            raise ValueError(f"generation_prompt must be True, False or None (True unless the role is "
                             f"{' or '.join(map(repr, NO_PROMPT_AFTER))}), got {generation_prompt!r}.")

    def render(self, messages: tuple[Message, ...], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except TemplateError as error:   # raise_exception(...) in the template, or one it cannot render
            raise ChatError(f"the model's chat template refuses this conversation ({error}); roles in order: "
                            f"{', '.join(role for role, _ in messages)}. Change the message's role or the "
                            f"conversation (many templates want user and assistant to alternate).") from None

    def encode(self, text: str) -> list[int]:
        """The ids of text the message appends."""
        if self.check_text is not None:
            self.check_text(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        # As the branch holds them: special tokens written out, spaces as they are.
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def sequence_start(self) -> str | None:
        """The BOS text the tokenizer puts at the start of a sequence, if it puts one there."""
        bos, bos_id = self.tokenizer.bos_token, self.tokenizer.bos_token_id
        if bos and self.tokenizer.encode("a", add_special_tokens=True)[:1] == [bos_id]:
            return bos
        return None

    def plan(self, state: ChatState | None, tokens: list[int], role: str, content: str,
             generation_prompt: bool, name: str) -> PlannedMessage:
        """The tokens one more message adds to a branch holding `tokens` with conversation `state`."""
        new: Message = (role, content)
        if state is None:   # the conversation starts here
            text = self.render((new,), generation_prompt)
            start = self.sequence_start()
            if tokens and start and text.startswith(start):
                text = text[len(start):]
            return PlannedMessage(self.encode(text), (new,))
        since = tokens[state.mark:]
        reply = state.generation_prompt and bool(since)
        if state.generation_prompt and not since and role != "assistant":
            raise ChatError(f"branch {name!r} ends with the assistant's generation prompt and no reply yet; "
                            f"generate the reply (generate() or %gen) or give it with chat({name!r}, 'assistant', "
                            f"text) before a {role!r} message.")
        prior = state.messages
        if reply:
            content_ids = [t for t in since if t not in self.end_token_ids]
            prior = prior + (("assistant", self.decode(content_ids)),)
        held = self.render(state.messages, state.generation_prompt) + self.decode(since)
        full = self.render(prior + (new,), generation_prompt)
        if full.startswith(held):
            return PlannedMessage(self.encode(full[len(held):]), prior + (new,))
        if reply:
            return PlannedMessage(self.encode(self._after_reply(state, since, new, generation_prompt, name)),
                                  prior + (new,))
        before = self.render(prior, state.generation_prompt)
        if not full.startswith(before):
            raise ChatError(f"the model's chat template writes the earlier turns of branch {name!r} differently "
                            f"once a {role!r} message follows them, so there is no one message to append; start "
                            f"the conversation again on a new branch.")
        return PlannedMessage(self.encode(full[len(before):]), prior + (new,))

    def _after_reply(self, state: ChatState, since: list[int], new: Message, generation_prompt: bool,
                     name: str) -> str:
        """The text the template writes after a reply's content (closing its turn) and for the new message,
        less the end tokens the reply already ended with."""
        marked = self.render(state.messages + (("assistant", REPLY_MARKER),) + (new,), generation_prompt)
        if marked.count(REPLY_MARKER) != 1:
            raise ChatError(f"the model's chat template rewrites the assistant's reply on branch {name!r} in a way "
                            f"chat() cannot follow; start the conversation again on a new branch.")
        after = marked[marked.index(REPLY_MARKER) + len(REPLY_MARKER):]
        trailing = len(since)
        while trailing and since[trailing - 1] in self.end_token_ids:
            trailing -= 1
        closed = self.decode(since[trailing:])
        return after[len(closed):] if closed and after.startswith(closed) else after
