"""Re-running a %%branch cell: cheap, and its result says so (issue 41).

The session remembers, per branch, what the last %%branch cell wrote to it (CellWrite). When the same cell runs
again and the branch is still as that cell left it, the text is not appended a second time:

- the same text, and nothing to generate: nothing to do;
- otherwise the branch goes back to where it was before the cell and the cell's text is written again. The
  engine's prefix reuse takes the tokens up to the first changed one from the old text, so only the rest is
  prefilled. A --gen cell then generates anew: its old generation is replaced.

"The same cell" is the cell id JupyterLab (and Notebook 7, VS Code, our nbval plugin) sends with the execute
request. Without one (a terminal IPython), only the same magic line with the same text counts: an edited cell
cannot be told from the next cell, which must append.

Going back and writing again are one engine call (Engine.atomic around Engine.rewind and Engine.write, with a
spare fork holding the old text meanwhile, for the write to reuse): if the write fails (Ctrl-C included), the
branch, the tree and the pool are exactly as they were.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from dendrite_nb import ChatError, Constraint, Engine, SamplingParams

from .arguments import user_errors
from .cell_options import cell_metadata

if TYPE_CHECKING:
    from dendrite_nb.engine.prefill import PrefillReport


@dataclass(frozen=True)
class CellWrite:
    """What one %%branch cell wrote to a branch."""

    cell: tuple[str, ...]            # which cell: ("id", cell id), or ("text", magic line, cell text)
    content: tuple[str | None, str]  # (chat role, or None for plain text; the text) the cell wrote
    length_before: int               # the branch's tokens before the cell
    text_end: int                    # the branch's tokens after the cell's text (its generation follows)
    constraint: Constraint | None    # the constraint the cell's generation put on the branch, at text_end
    tokens: tuple[int, ...]          # the branch's tokens as the cell left them


def cell_key(shell: Any, line: str, cell: str) -> tuple[str, ...]:
    """The running cell's identity (see the module docstring)."""
    cell_id = (cell_metadata(shell) or {}).get("cellId")
    if cell_id:
        return ("id", str(cell_id))
    return ("text", line.strip(), cell)


def rerun_of(writes: dict[str, CellWrite], engine: Engine, name: str, parent: str | None,
             cell: tuple[str, ...]) -> CellWrite | None:
    """The write this cell made to branch `name` last time, if it is this cell again and the branch (and the
    --from parent) are still as that cell left them; else None (the cell appends, or forks, as a new one)."""
    record = writes.get(name)
    if record is None or record.cell != cell or name not in engine.branches:
        return None
    if tuple(engine.branch(name).tokens) != record.tokens:
        return None   # generated, appended or rewound since: the cell's text is no longer its end
    if parent is not None:
        if parent not in engine.branches:
            return None
        held = engine.branch(parent).tokens
        if len(held) != record.length_before or tuple(held) != record.tokens[:record.length_before]:
            return None
    return record


def check_rewrite_fits(engine: Engine, name: str, record: CellWrite, body: str, gen: int) -> None:
    """Refuse, before anything changes, a plain-text rewrite the context or the pool cannot hold (counting every
    token of the text as new: the old text keeps its blocks until the new one is written). A chat message's
    tokens depend on the conversation before it: Engine.write checks those, and a refusal puts the branch back."""
    if record.content[0] is not None:
        return
    with user_errors():   # text past the context is refused before it is tokenized
        tokens = engine.encode(body, at_start=record.length_before == 0) if body else []
    total = record.length_before + len(tokens) + gen
    context = engine.config.max_position_embeddings
    if total > context:
        raise UsageError(f"this cell would make branch {name!r} {total:,} tokens long ({record.length_before:,} "
                         f"before the cell, {len(tokens):,} of its text, {gen:,} to generate) and the model's "
                         f"context holds {context:,}; shorten the text or generate fewer tokens.")
    size = engine.block_size
    needed = -(-total // size) - record.length_before // size + 1   # +1: a copy-on-write block where it starts
    available = engine.num_free_blocks + engine.num_cached_blocks
    if needed > available:
        raise UsageError(f"re-running this cell on branch {name!r} needs up to {needed:,} free KV blocks while its "
                         f"old text holds its own, and {available:,} are free; prune some branches, or generate "
                         f"fewer tokens.")


def rewrite(engine: Engine, name: str, record: CellWrite, content: Any, role: str | None, logprobs: bool,
            gen: int, sampling: SamplingParams, constraint: Constraint | None,
            parent: str | None = None) -> PrefillReport | None:
    """Put branch `name` back to before the cell, then write `content` as Engine.write would (room_for=gen), all
    or nothing. Returns the write's PrefillReport; None when the engine refuses to go back (a chat message in the
    middle of a conversation: rewinding cuts whole conversations only), having changed nothing.

    parent: the cell's --from branch. A chat message written onto a fork of a conversation cannot be rewound to
    the fork's start either (closing the parent's last reply put tokens of it there), but the cell made that fork:
    it is made again, from the parent (which rerun_of found unchanged)."""
    branch = engine.branch(name)
    back_to = record.length_before
    if role is None and not content and back_to > 0:
        # A cell that adds no text: the state after the kept tokens is known again only once one is written.
        back_to -= 1
        content = [record.tokens[back_to]]
    with engine.atomic():
        # The old text stays reachable from a spare fork while the new one is written, so that the write reuses
        # its KV up to the first changed token; the spare goes at the end of the same call.
        spare = engine.fork(branch, names=[_spare_name(engine, name)])[0]
        fork_of = None
        try:
            engine.rewind(branch, back_to)
        except ChatError:   # it would cut into the conversation's messages
            if parent is None:   # the cell appends a new message instead
                engine.prune(spare)
                return None
            engine.prune(branch)
            fork_of = parent
        if fork_of is None and record.constraint is not None and branch.constraint is not None:
            engine.constrain(branch, None)   # the cell's generation put it there; its text goes in without
        engine.write(name, content, fork_of=fork_of, role=role, logprobs=logprobs, room_for=gen, sampling=sampling,
                     constraint=constraint)
        report = engine.prefill_report
        engine.prune(spare)
    return report


def _spare_name(engine: Engine, name: str) -> str:
    spare, count = f"{name} (before re-run)", 1
    while spare in engine.branches:
        count += 1
        spare = f"{name} (before re-run {count})"
    return spare
