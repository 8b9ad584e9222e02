"""The tokens one more chat message adds to a branch, planned (and checked) before anything changes.

The rules of a conversation (what a template writes for each message, what becomes the assistant's reply) are
in chat.py; this applies them to a branch of the tree: its conversation so far and the tokens since.
"""
from __future__ import annotations

from typing import Any

from ..chat import NO_PROMPT_AFTER, ChatState, ChatTemplate
from .branch_state import Branch
from .inputs import Inputs


def plan_message(tokenizer: Any, inputs: Inputs, branch: Branch, role: str, content: str,
                 generation_prompt: bool | None) -> tuple[list[int], tuple[tuple[str, str], ...], bool]:
    """(the message's token ids, the conversation's messages after it, whether it opens the assistant's turn);
    raises ChatError (or ContextOverflow, from the text's length alone) and changes nothing."""
    template = ChatTemplate(tokenizer, inputs.eos_token_ids,
                            lambda text: inputs.check_text_fits(text, branch.name, len(branch)))
    template.check(role, content, generation_prompt)
    prompt = role not in NO_PROMPT_AFTER if generation_prompt is None else generation_prompt
    state = branch.chat
    # Only the tokens since the last chat call matter to the plan (and whether the branch is empty).
    tokens = branch.tokens if state is None or state.mark < len(branch) else []
    planned = template.plan(state, tokens, role, content, prompt, branch.name)
    return planned.tokens, planned.messages, prompt


def plan_messages(tokenizer: Any, inputs: Inputs, branch: Branch, messages: list[tuple[str, str]],
                  generation_prompt: bool | None) -> tuple[list[int], ChatState]:
    """(the token ids of several messages added in turn, the conversation after the last): what chat() for each
    of them would add, one after the other, planned at once so that one prefill can add them all.
    generation_prompt applies to the last message (the others open no assistant turn: a reply follows only the
    last). Raises as plan_message does, changing nothing."""
    length, state, all_tokens = len(branch), branch.chat, []
    held = branch.tokens if state is None or state.mark < len(branch) else []
    last = len(messages) - 1
    for position, (role, content) in enumerate(messages):
        template = ChatTemplate(tokenizer, inputs.eos_token_ids,
                                lambda text, have=length: inputs.check_text_fits(text, branch.name, have))
        asked = generation_prompt if position == last else False
        template.check(role, content, asked)
        prompt = role not in NO_PROMPT_AFTER if asked is None else asked
        planned = template.plan(state, held, role, content, prompt, branch.name)
        all_tokens += planned.tokens
        length += len(planned.tokens)
        state, held = ChatState(planned.messages, length, prompt), []
    return all_tokens, state
