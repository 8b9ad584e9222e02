"""%gen, and the streaming generation that it and `%%branch --gen` share: the engine's decode steps drawn live into
the cell's output (live.py), the texts returned as a Generated result. While the kernel's server runs, the
branches decode in the server's batch instead (server_gen.py)."""
from __future__ import annotations

import math

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from dendrite_nb import Branch, Constraint, Engine, GenerationInterrupted, SamplingParams

from .arguments import parse_arguments, sampling_arguments, sampling_from, user_errors
from .cell_options import cell_constraint, split_inline_options
from .live import LiveGeneration
from .results import Generated
from .server_gen import decode_in_server_batch
from .session import Session, SessionBoundMagics


@magics_class
class GenMagics(SessionBoundMagics):
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
        While `%dendrite serve` runs, the branches join the server's running batch: they decode in the
        same batched forward as the HTTP requests (--max-batch is refused then).
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
        constraint = cell_constraint(self.shell, inline, generating=True)
        branches = self.session.select(args.branches)
        return stream_generation(self.session, branches, args.max_tokens, sampling, constraint, args.max_batch,
                                 args.priority, args.logprobs)


def stream_generation(session: Session, branches: list[Branch], max_tokens: int, sampling: SamplingParams,
                      constraint: Constraint | None, max_batch: int | None = None,
                      priority: float | None = None, logprobs: bool = False, note: str | None = None) -> Generated:
    """Generate on `branches`, streaming them into the cell's output (LiveGeneration); the result is also kept as
    the session's last_result, an interrupted generation's too. note: what the cell did first (Generated.note)."""
    engine = session.require_engine()
    server = session.running_server()
    if server is not None and max_batch is not None:
        raise UsageError(f"--max-batch does not apply while the kernel's server runs ({server.url}): its batch "
                         f"decodes every running branch at each step. Drop --max-batch, or stop the server first "
                         f"(%dendrite serve stop).")
    with user_errors():  # refuse before the live view appears, so a refused cell shows only the error
        engine.check_generate(branches, max_tokens, sampling, constraint)
    if priority is not None:  # only once every refusal has had its chance: a refused cell changes nothing
        engine.set_priority(branches, priority)
    per_step = len(branches) if max_batch is None else max_batch
    live = LiveGeneration(engine, branches, max_tokens * -(-len(branches) // per_step))
    try:
        if server is None:
            with engine.subscribe(live), user_errors():
                outputs = engine.generate(branches, max_tokens, sampling, constraint, max_batch=max_batch,
                                          logprobs=logprobs)
        else:
            with user_errors():
                outputs = decode_in_server_batch(server.scheduler, engine, branches, max_tokens, sampling,
                                                 constraint, logprobs, live)
    except GenerationInterrupted as interrupted:
        live.finish(interrupted=True)
        session.last_result = _result(engine, branches, interrupted.outputs, live, interrupted.steps_done, True,
                                      logprobs, note)
        raise
    finally:
        session.generated()  # an interrupted cell kept its tokens: it counts for autosave too
    live.finish(interrupted=False)
    session.last_result = _result(engine, branches, outputs, live, live.steps, False, logprobs, note)
    return session.last_result


def _result(engine: Engine, branches: list[Branch], outputs: list[list[int]], live: LiveGeneration,
            steps: int, interrupted: bool, logprobs: bool = False, note: str | None = None) -> Generated:
    texts = tuple(engine.decode(out, skip_end_tokens=True) if engine.tokenizer else str(out) for out in outputs)
    # The new tokens are each branch's last ones; a branch generated nothing when it was already done.
    kept = (tuple(tuple(engine.logprobs(b)[len(b) - len(out):]) if out else () for b, out in zip(branches, outputs))
            if logprobs else None)
    return Generated(tuple(b.name for b in branches), tuple(tuple(o) for o in outputs), texts,
                     steps, live.max_steps, live.seconds, interrupted, logprobs=kept, note=note)
