"""The magics that change or read the tree's branches: %%branch (write to a branch, then maybe generate), %fork,
%prune and %show.

Each checks all of its input before it changes anything: a refused cell leaves the tree as it was.
"""
from __future__ import annotations

from dataclasses import replace

from IPython.core.error import UsageError
from IPython.core.magic import cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from dendrite_nb.wording import counted

from .arguments import parse_arguments, sampling_arguments, sampling_from, sampling_options_set, user_errors
from .cell_options import cell_constraint, split_inline_options
from .gen_magic import stream_generation
from .rerun import CellWrite, cell_key, check_rewrite_fits, rerun_of, rewrite
from .results import Branches, Pruned
from .session import SessionBoundMagics, check_new_name
from .show import show_branch


def _rerun_note(action: str, record: CellWrite) -> str:
    replaced = len(record.tokens) - record.text_end
    return action + (f"; its earlier generation ({counted(replaced, 'token')}) is replaced" if replaced else "")


def cell_text(cell: str) -> str:
    # The front end ends a cell without a newline; IPython hands a cell magic its body with one.
    return cell[:-1] if cell.endswith("\n") else cell


@magics_class
class BranchMagics(SessionBoundMagics):
    @magic_arguments()
    @argument("name", help="the branch to create, or to extend when it exists")
    @argument("--from", dest="parent", default=None, help="fork NAME from this branch first (NAME must be new)")
    @argument("--gen", type=int, default=0, metavar="N", help="then generate up to N tokens, streaming")
    @argument("--chat", action="store_true",
              help="add the cell text as one more chat message, as the model's chat template writes it")
    @argument("--role", default=None, help="the chat message's role: user (default), system, assistant, ...")
    @argument("--logprobs", action="store_true",
              help="score the cell's text (its mean log-probability) and keep the generated tokens' too")
    @sampling_arguments
    @cell_magic
    def branch(self, line: str, cell: str):
        """Append the cell's text to a branch: a new one from the root, a fork of --from, or an existing one.

        Leading `#| json_schema: ...` / `#| regex: ...` lines are constraint options, not prompt
        text (see "Constraints from cell metadata" in docs/notebooks.md).

        With --chat the cell is one more message of the branch's conversation (role --role, default
        user), written as the model's chat template writes it: the first one starts the conversation
        (with the template's default system prompt, if it has one), and after a user message the
        assistant's turn opens, so --gen N generates the reply. What the branch gained since its last
        chat message (a reply) becomes the assistant's message. Forks of a conversation share its KV.

        Running the same cell again, while its branch is still as the cell left it, does not append
        the text twice: the same text is a no-op that says so; edited text replaces the old, and only
        the tokens from the first changed one are prefilled (the result says how many were reused);
        with --gen, the old generation is replaced by a new one. "The same cell" is the cell id the
        front end sends (JupyterLab, Notebook 7, VS Code); without one, the same line and text.
        A branch changed since (generated, appended to) gets the text appended, as a new cell would.

        Examples::

          %%branch root
          A river blocks the road. Three ways across:

          %%branch careful --from root --gen 40 --temperature 0.7
          The safest way is

          %%branch root
          and one more thing.

          %%branch answer/1 --from question --logprobs
          Swim across.                             # the result shows this text's mean log-probability

          %%branch chat --chat --gen 64 -t 0
          What is the capital of France?

          %%branch chat/de --from chat --chat --gen 64 -t 0
          And of Germany?                          # a new turn; the first one's KV is shared

          %%branch tutor --chat --role system
          You answer in one short sentence.
        """
        args = parse_arguments(self.branch, line)
        engine = self.session.require_engine()
        inline, body = split_inline_options(cell_text(cell))
        if args.gen < 0:
            raise UsageError(f"--gen takes a number of tokens >= 0, got {args.gen}.")
        if args.role is not None and not args.chat:
            raise UsageError(f"--role {args.role} is a chat message's role; add --chat, or drop --role.")
        role = (args.role if args.role is not None else "user") if args.chat else None
        ignored = sampling_options_set(self.branch, args) if not args.gen else []
        if ignored:
            raise UsageError(f"{', '.join(ignored)} only apply when the cell generates; add --gen N, or drop them.")
        sampling = sampling_from(args)
        constraint = cell_constraint(self.shell, inline, generating=args.gen > 0)
        content = body if body or args.chat else []   # an empty cell adds no token (not even a BOS)
        cell_id = cell_key(self.shell, line, cell)
        record = rerun_of(self.session.cell_writes, engine, args.name, args.parent, cell_id)
        if record is not None and record.content == (role, body) and not args.gen and not args.logprobs:
            return Branches(f"{args.name} unchanged, the cell's text is already there", (args.name,),
                            (len(record.tokens),), engine.num_free_blocks)
        report = None
        if record is not None:
            check_rewrite_fits(engine, args.name, record, body, args.gen)
            with user_errors():
                report = rewrite(engine, args.name, record, content, role, args.logprobs, args.gen, sampling,
                                 constraint, parent=args.parent)
        if report is not None:
            branch, before = engine.branch(args.name), record.length_before
            counts = f"reused {counted(report.reused_tokens, 'token')}, prefilled {report.prefilled_tokens:,}"
            action = (f"{args.name}: the cell's text is there already ({counts})" if record.content == (role, body)
                      else f"rewrote {args.name} from the cell's first changed token ({counts})")
        else:
            branch, before, action = self._write(args, engine, body, content, role, sampling, constraint)
            if record is not None:   # the same cell, but rewind() refused to go back into a conversation
                action += (" (this cell ran before, but a conversation goes back only to the end of a message: "
                           "its text was added again)")
        written = CellWrite(cell_id, (role, body), before, len(branch), constraint if args.gen else None, ())
        if args.gen:
            note = None if record is None else _rerun_note(action, record) if report is not None else action
            try:
                return stream_generation(self.session, [branch], args.gen, sampling, constraint,
                                         logprobs=args.logprobs, note=note)
            finally:   # an interrupted generation too: the branch kept its tokens, and a re-run replaces them
                self._remember(args.name, written)
        self._remember(args.name, written)
        # Only with --logprobs: reading them walks the branch's whole path.
        scored = [lp for lp in engine.logprobs(branch)[before:] if lp is not None] if args.logprobs else []
        return Branches(action, (branch.name,), (len(branch),), engine.num_free_blocks,
                        sum(scored) / len(scored) if scored else None,
                        report.reused_tokens if report is not None else None,
                        report.prefilled_tokens if report is not None else None)

    def _write(self, args, engine, body: str, content, role: str | None, sampling, constraint):
        """The cell's text onto a new branch, a fork, or the end of an existing one: (branch, its length before the
        text, what the result says it did)."""
        with user_errors():
            exists = args.name in engine.branches
            extending = exists and args.parent is None
            if not extending:
                check_new_name(args.name)
            if args.gen and not args.chat and not body and (extending or not exists):   # else write refuses the name
                start = engine.branch(args.parent) if args.parent is not None else engine.branches.get(args.name)
                if start is None or len(start) == 0:
                    raise UsageError(f"branch {args.name!r} would have no tokens to generate from; write a prompt "
                                     f"in the cell.")
            before = len(engine.branch(args.name)) if extending else 0
            # One engine call, all or nothing: refused (a taken name, no room for the tokens to generate, a
            # completed grammar), the cell changes nothing, a fork or new branch included.
            branch = engine.write(args.name, content, fork_of=args.parent, role=role, logprobs=args.logprobs,
                                  room_for=args.gen, sampling=sampling, constraint=constraint)
        if args.parent is not None:
            before = len(engine.branch(args.parent))   # a fork starts where its parent ends (write left it as it was)
        added = len(branch) - before
        action = "appended to" if extending else f"forked from {args.parent}" if args.parent is not None else "created"
        return branch, before, f"{action} {args.name}" if added or not extending else f"{args.name} unchanged"

    def _remember(self, name: str, written: CellWrite) -> None:
        """What this cell wrote to the branch, as it leaves it (for a re-run of the cell: rerun.py)."""
        engine = self.session.engine
        if engine is not None and not engine.closed and name in engine.branches:
            self.session.cell_writes[name] = replace(written, tokens=tuple(engine.branch(name).tokens))

    # ---- %fork ----------------------------------------------------------------------------------------
    @magic_arguments()
    @argument("parent", help="the branch to fork")
    @argument("children", nargs="*", help="names of the new branches")
    @argument("--n", "-n", type=int, default=None, help="make N children named PARENT/0, PARENT/1, ...")
    @line_magic
    def fork(self, line: str = ""):
        """New branches at the same point as PARENT: O(1), no KV block is copied until a child writes.

        Examples::

          %fork root plan_a plan_b
          %fork root --n 5
          kids = %fork root -n 3
          for name in kids: print(name)
        """
        args = parse_arguments(self.fork, line)
        engine = self.session.require_engine()
        if bool(args.children) == (args.n is not None):
            raise UsageError("give the children's names (%fork PARENT A B) or a count (%fork PARENT --n K)"
                             + (", not both." if args.children else "."))
        if args.n is not None and args.n < 1:
            raise UsageError(f"--n takes a count >= 1, got {args.n}.")
        for name in args.children:
            check_new_name(name)
        with user_errors():
            kids = engine.fork(args.parent, args.n, names=args.children or None)
        return Branches(f"forked {args.parent}", tuple(k.name for k in kids), tuple(len(k) for k in kids),
                        engine.num_free_blocks)

    # ---- %prune ---------------------------------------------------------------------------------------
    @magic_arguments()
    @argument("branches", nargs="+", help="branch names or glob patterns")
    @line_magic
    def prune(self, line: str = ""):
        """Remove branches; KV blocks that no remaining branch reads return to the free list.

        Examples::

          %prune plan/1 plan/2
          %prune plan/*
        """
        args = parse_arguments(self.prune, line)
        engine = self.session.require_engine()
        branches = self.session.select(args.branches)
        with user_errors():
            freed = engine.prune(branches)
        return Pruned(tuple(b.name for b in branches), freed, engine.num_free_blocks)

    # ---- %show ----------------------------------------------------------------------------------------
    @magic_arguments()
    @argument("branch", help="the branch to show")
    @line_magic
    def show(self, line: str = ""):
        """A branch's whole text from the root; ⑂ marks where the tree forks along its path.

        Examples::

          %show plan/0
          shown = %show plan/0
          shown.text
        """
        args = parse_arguments(self.show, line)
        engine = self.session.require_engine()
        with user_errors():
            branch = engine.branch(args.branch)
        return show_branch(engine, branch.name)
