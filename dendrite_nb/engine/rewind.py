"""Rewinding a branch: it keeps only its first tokens, and what it held past them is collected (or cached).

The tree's half is kv/prefix.py's rewind; this adds what the engine keeps per branch. Its conversation stays only
if the cut spares the last message chat() added. Its grammar position is worked out again for the tokens it keeps.
No forward runs: when the cut falls inside a node, the hidden state after the last kept token (what a decode step
reads) is not known until the branch grows again, which is what a rewind is for (rewind, then append the edited
text: the append prefills it, reusing what the tree still holds past the cut).

Every change is logged in the call's journal (kv/journal.py): a rewind that fails changes nothing.
"""
from __future__ import annotations

from ..kv import BranchTree, KVPool
from ..kv.journal import Journal, restore_attrs
from ..errors import ChatError
from ..kv.prefix import rewind as rewind_tree
from .branch_state import Branch
from .grammars import Grammars
from .preemption import Preemption


def check_rewind(branch: Branch, num_tokens: int) -> None:
    """Raise ChatError (a ValueError), before anything changes, if the rewind would cut into a conversation's
    messages."""
    chat = branch.chat
    if chat is not None and 0 < num_tokens < chat.mark:
        raise ChatError(f"branch {branch.name!r} holds a conversation whose last message ends at token "
                         f"{chat.mark:,}; rewinding it to {num_tokens:,} would cut into its messages. Rewind to "
                         f"{chat.mark:,} or more, or to 0 to start again.")


def rewind(tree: BranchTree, pool: KVPool, grammars: Grammars, preemption: Preemption, journal: Journal,
           branch: Branch, num_tokens: int) -> None:
    """Make `branch` hold only its first num_tokens tokens (fewer than it holds; check_rewind passed)."""
    tokens = branch.tokens if branch.matcher is not None else None   # what the grammar is worked out over
    node = branch.node
    if node.swapped_blocks and num_tokens > node.start:   # the cut falls in its parked KV: bring it back first
        preemption.resume(branch)
    copy = rewind_tree(tree, branch, num_tokens)[1]
    if copy is not None:
        pool.copy_block(*copy)
    if branch.chat is not None and num_tokens < branch.chat.mark:   # to 0: the conversation starts again
        journal.log(restore_attrs, branch, {"chat": branch.chat})
        branch.chat = None
    if branch.matcher is not None:
        _regrammar(grammars, journal, branch, tokens, num_tokens)


def _regrammar(grammars: Grammars, journal: Journal, branch: Branch, tokens: list[int], num_tokens: int) -> None:
    """The branch's grammar position after its first num_tokens tokens: from the grammar's start, over the kept
    tokens since the constraint was attached (a cut before that point attaches it again, at the cut)."""
    journal.log(restore_attrs, branch, {"matcher": branch.matcher, "constraint_from": branch.constraint_from})
    matcher = grammars.start(branch.constraint)
    since = min(branch.constraint_from, num_tokens)
    if since < num_tokens:
        matcher.consume_tokens(tokens[since:num_tokens])
    branch.matcher, branch.constraint_from = matcher, since
