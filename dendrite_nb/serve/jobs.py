"""Each request's branches, made on the engine thread: a prompt branch, prefilled, then forked into its choices.

A request names its branches after its response id: `<id>` for one choice, `<id>/<i>` for several. They are
forks of one prompt branch (n > 1 is a fork: the prompt is prefilled once). A request that continues an earlier
response (x-dendrite-parent, previous_response_id) forks that response's branch, so nothing it holds is prefilled
again; a fresh prompt still reuses whatever prefix the tree holds (the engine's prefix reuse). Either way the
tokens not prefilled are reported as cached.

Chat messages go on one by one through Engine.chat, which keeps the conversation on the branch: the reply a
response generates becomes the assistant's message when a continuation adds the next one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ..sampling import derive_seed
from .errors import APIError
from .protocol import Message
from .retention import Retention
from .scheduler import Prepared

# A chat or responses request without max_tokens generates until it stops, up to this many tokens (and the
# context's end): the scheduler reserves KV for a request's whole budget before admitting it.
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class PromptPlan:
    """What to put on a request's prompt branch: a completions prompt, or chat messages."""

    prompt: str | Sequence[int] | None = None           # completions: text (gets BOS) or token ids
    messages: tuple[Message, ...] = ()                  # chat / responses: appended as chat messages, in order
    keep_prompt_logprobs: bool = False                  # completions with echo and logprobs


@dataclass(frozen=True)
class ChoicePlan:
    """A request, as the engine thread makes it: its prompts (one per completions prompt, else one), n choices
    each, and how they decode."""

    response_id: str
    prompts: tuple[PromptPlan, ...]
    n: int
    parent: str | None                  # a response id (or "<id>/<choice>") to continue from
    max_new_tokens: int | None
    sampling: Any
    constraint: dict | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_names(self) -> list[str]:
        if self.num_choices == 1:
            return [self.response_id]
        return [f"{self.response_id}/{i}" for i in range(self.num_choices)]


def prepare(engine: Any, retention: Retention, plan: ChoicePlan) -> Prepared:
    """Make and prefill the request's branches; all or nothing (a failure prunes what it made and re-raises).
    Runs on the engine thread."""
    parent = None
    if plan.parent is not None:
        parent = retention.branch_of(plan.parent)
        if parent is None or parent not in engine.branches:
            raise APIError(f"no response {plan.parent!r} is kept here (it was deleted or let go of, or it has "
                           f"several choices: name one as '<id>/<choice>'); start from the whole conversation.",
                           param="previous_response_id" if plan.parent.startswith("resp_") else "x-dendrite-parent",
                           code="response_not_found", status=404)
    names = plan.choice_names()
    made: list[str] = []
    try:
        choices, prompt_tokens, prefilled, echo = [], 0, 0, []
        for index, prompt in enumerate(plan.prompts):
            base = names[0] if plan.num_choices == 1 else f"{plan.response_id}/prompt{index}"
            branch, filled = _prompt_branch(engine, base, parent, prompt, made)
            prompt_tokens, prefilled = prompt_tokens + len(branch), prefilled + filled
            echo.append(_echo(engine, branch, prompt, parent))
            if plan.num_choices == 1:
                choices.append(branch)
                continue
            mine = names[index * plan.n:(index + 1) * plan.n]
            choices.extend(engine.fork(branch, names=mine))
            made.extend(mine)
            engine.prune(branch)   # the choices hold its tokens; the name is not a response
            made.remove(base)
        sampling = plan.sampling
        if sampling.seed is not None:
            # A choice's noise from (the request's seed, its index): the same request gives the same answer.
            for index, choice in enumerate(choices):
                engine.reseed(choice, derive_seed(sampling.seed, str(index)))
            sampling = dataclasses.replace(sampling, seed=None)
        budget = plan.max_new_tokens
        if budget is None:
            context = engine.config.max_position_embeddings
            budget = max(1, min(DEFAULT_MAX_TOKENS, context - max(len(b) for b in choices)))
        info = {"prompt_tokens": prompt_tokens, "cached_tokens": prompt_tokens - prefilled, "echo": echo,
                "names": tuple(names)}
        return Prepared(choices, budget, sampling, plan.constraint, plan.logprobs, plan.top_logprobs, info)
    except BaseException:
        live = [name for name in made if name in engine.branches]
        if live:
            engine.prune(live)
        raise


def _prompt_branch(engine: Any, name: str, parent: str | None, prompt: PromptPlan, made: list[str]
                   ) -> tuple[Any, int]:
    """The prompt branch (a fork of the parent, or new) with the prompt prefilled; and the tokens prefilled."""
    branch = engine.fork(parent, names=[name])[0] if parent is not None else engine.new_branch(name)
    made.append(name)
    prefilled = 0
    if prompt.messages:
        # One prefill for the whole conversation: only the last message opens the assistant's turn.
        engine.chat_many(branch, [(m.role, m.content) for m in prompt.messages])
        prefilled += engine.prefill_report.prefilled_tokens
    elif prompt.prompt is not None and len(prompt.prompt):
        engine.append(branch, prompt.prompt if isinstance(prompt.prompt, str) else list(prompt.prompt),
                      logprobs=prompt.keep_prompt_logprobs)
        prefilled += engine.prefill_report.prefilled_tokens
    return branch, prefilled


def _echo(engine: Any, branch: Any, prompt: PromptPlan, parent: str | None) -> tuple[list[int], list]:
    """The prompt's own tokens and their log-probabilities (None where none was kept), for completions' echo."""
    if prompt.prompt is None:
        return [], []
    start = len(engine.branch(parent)) if parent is not None else 0
    tokens = branch.tokens[start:]
    logprobs = engine.logprobs(branch)[start:] if prompt.keep_prompt_logprobs else [None] * len(tokens)
    return tokens, logprobs


def abandon(engine: Any, prepared: Prepared) -> None:
    """A request that will not finish (its client went away, or it failed): its branches go."""
    live = [b.name for b in prepared.branches if b.name in engine.branches and engine.branches[b.name] is b]
    if live:
        engine.prune(live)


def blocks_for(engine: Any, prompt_tokens: int, num_choices: int, max_new_tokens: int | None) -> int:
    """The KV blocks a request may take at most: its prompt, and each choice's budget (with a copy-on-write block
    at the fork)."""
    size = engine.block_size
    budget = max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_TOKENS
    return -(-prompt_tokens // size) + 1 + num_choices * (-(-budget // size) + 1)


def check_prompt_fits(engine: Any, prompt_tokens: int, max_new_tokens: int | None, param: str) -> None:
    """A 400 with the numbers when the prompt and the tokens asked for cannot fit the model's context."""
    context = engine.config.max_position_embeddings
    asked = max_new_tokens or 1
    if prompt_tokens + asked > context:
        raise APIError(f"this request needs {prompt_tokens + asked:,} tokens ({prompt_tokens:,} in the prompt + "
                       f"{asked:,} to generate) and the model's context holds {context:,}; shorten the prompt or "
                       f"ask for fewer tokens.", param=param, code="context_length_exceeded")
