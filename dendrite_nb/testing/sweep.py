"""The injection sweep: every engine operation, a fault at every executed line, and no damage after any of them.

For each operation, a fresh engine over one tiny model is populated with a tree that has everything the
operation can meet (forks, a branch swapped to host memory, one whose KV was dropped, a constrained branch),
and a fault (KeyboardInterrupt, or separately RuntimeError) is raised at the n-th executed line of dendrite-nb
code (faults.LineFault). Then:
- `audit()` passes (refcounts, free list, node invariants, no pending token);
- an all-or-nothing operation that raised left the tree, the block table and the free blocks exactly as they
  were; a generate that raised kept, on each branch, exactly the tokens of its completed steps (a prefix of
  what an uninterrupted run decodes);
- every branch's next-token logits equal a fresh prefill of its tokens in a second engine (1e-4), and so do
  they after the next call (one greedy step of every branch, which reads all of their KV, resumes included).

`python -m dendrite_nb.testing.sweep` runs every line of every operation (minutes); the test suite runs a
seeded sample of lines (tests/engine/test_fault_sweep.py).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..engine import Engine
from ..sampling import SamplingParams
from .checkpoints import write_tiny_checkpoint
from .faults import LineFault, count_lines

PROMPT = list(range(3, 21))   # 18 tokens: with 4-token blocks, a partial tail block, so forks copy on write
BLOCK_SIZE, CHUNK_TOKENS = 4, 8   # prefills of more than 8 tokens run in several forwards
LOGITS_TOLERANCE = 1e-4


def populate(engine: Engine) -> None:
    """The tree every operation starts from: a forked prompt, a branch swapped out to host memory ("s"), one
    whose KV was dropped for recompute ("r"), a leaf that can be preempted ("v"), a constrained branch ("c")."""
    engine.new_branch("a", PROMPT)
    engine.fork("a", 2)
    engine.generate(["a/0", "a/1"], 3)
    engine.new_branch("s", list(range(30, 41)))
    engine.generate("s", 2)
    engine.preempt("s")
    engine.host_memory_limit_bytes = 0   # no host room: preempting drops the KV, resuming recomputes it
    engine.new_branch("r", list(range(50, 57)))
    engine.preempt("r")
    engine.host_memory_limit_bytes = None
    engine.new_branch("v", list(range(60, 70)))
    engine.new_branch("c", PROMPT[:6])
    engine.constrain("c", {"regex": "(yes|no)+"})


@dataclass(frozen=True)
class Operation:
    name: str
    run: Callable[[Engine], Any]
    all_or_nothing: bool = True       # False: generate, whose completed steps stay
    spare_blocks: int | None = None   # a pool this many blocks larger than populate needs (None: roomy)


GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)

OPERATIONS = [
    Operation("new_branch", lambda e: e.new_branch("n", list(range(70, 90)))),
    # a's prompt is reused up to token 10, off a block boundary: a's node is split and a block copied
    Operation("new_branch (reusing a prefix)", lambda e: e.new_branch("n", PROMPT[:10] + list(range(70, 80)))),
    Operation("rewind", lambda e: e.rewind("a/1", len(PROMPT))),
    Operation("append", lambda e: e.append("a/0", list(range(5, 25)))),
    Operation("append_many", lambda e: e.append_many([("a/0", [7, 8, 9]), ("a/1", list(range(10, 22))),
                                                      ("s", [3, 4])])),
    Operation("fork", lambda e: e.fork("a/0", 3)),
    Operation("prune", lambda e: e.prune("a/1", "a", "r", "s")),
    Operation("preempt", lambda e: e.preempt("a/0")),
    Operation("resume (swapped)", lambda e: e.append("s", [3, 4, 5])),
    Operation("resume (recompute)", lambda e: e.append("r", [3, 4, 5])),
    Operation("generate (greedy)", lambda e: e.generate(["a/0", "a/1", "a"], 3, GREEDY), all_or_nothing=False),
    Operation("generate (sampled)", lambda e: e.generate(["a/0", "a/1"], 3, SAMPLED), all_or_nothing=False),
    Operation("generate (constrained)", lambda e: e.generate(["c", "a/0"], 3, GREEDY), all_or_nothing=False),
    Operation("generate (resuming)", lambda e: e.generate(["s", "r"], 2, GREEDY), all_or_nothing=False),
    Operation("generate (preempting)", lambda e: e.generate(["a/0", "a/1"], 6, GREEDY, max_batch=1),
              all_or_nothing=False, spare_blocks=2),
]


@dataclass(frozen=True)
class Baseline:
    tokens: dict[str, list[int]]   # each branch's tokens after an uninterrupted run
    state: tuple                   # (tree(), block_table(), num_free_blocks) after it


class Sweep:
    """One tiny model (with a tokenizer, for constraints) shared by every engine of the sweep, and a second
    engine over the same weights whose fresh prefills are the reference."""

    def __init__(self, folder: str | None = None):
        self._folder = folder or tempfile.mkdtemp(prefix="dendrite-sweep-")
        write_tiny_checkpoint(self._folder)
        base = Engine.from_pretrained(self._folder, block_size=BLOCK_SIZE, num_blocks=256,
                                      prefill_chunk_tokens=CHUNK_TOKENS)
        self.model, self.tokenizer = base.model, base.tokenizer
        self.reference = Engine(self.model, self.tokenizer, block_size=BLOCK_SIZE, num_blocks=256)
        self._reference_logits: dict[tuple[int, ...], torch.Tensor] = {}
        roomy = self._populated(256)
        self._used_blocks = roomy.pool.num_blocks - roomy.num_free_blocks

    def _populated(self, num_blocks: int) -> Engine:
        engine = Engine(self.model, self.tokenizer, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                        prefill_chunk_tokens=CHUNK_TOKENS, debug=True)   # canaries: a write to a freed block shows
        populate(engine)
        return engine

    def fresh(self, operation: Operation) -> Engine:
        blocks = 256 if operation.spare_blocks is None else self._used_blocks + operation.spare_blocks
        return self._populated(blocks)

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self._reference_logits:
            self.reference.new_branch("ref", tokens)
            self._reference_logits[key] = self.reference.next_logits("ref")[0]
            self.reference.prune("ref")
        return self._reference_logits[key]

    def check_logits(self, engine: Engine, where: str) -> None:
        for name, branch in engine.branches.items():
            if len(branch) == 0:
                continue
            got, want = engine.next_logits(name)[0], self.reference_logits(branch.tokens)
            error = float((got - want).abs().max())
            if error > LOGITS_TOLERANCE:
                raise AssertionError(f"{where}: branch {name!r}'s logits differ from a fresh prefill by {error:.2e}")

    def baseline(self, operation: Operation) -> Baseline:
        """What the operation leaves when it runs without a fault."""
        engine = self.fresh(operation)
        operation.run(engine)
        return Baseline({name: branch.tokens for name, branch in engine.branches.items()},
                        (engine.tree(), engine.block_table(), engine.num_free_blocks))

    def inject(self, operation: Operation, line: int, exception: type[BaseException], expected: Baseline) -> bool:
        """Run the operation with a fault at `line`; raise AssertionError on any damage. Returns whether it fired."""
        engine = self.fresh(operation)
        before = (engine.tree(), engine.block_table(), engine.num_free_blocks)
        tokens_before = {name: branch.tokens for name, branch in engine.branches.items()}
        where = f"{operation.name}, {exception.__name__} at line {line}"
        raised = None
        fault = LineFault(line, exception)
        try:
            with fault:
                operation.run(engine)
        except (KeyboardInterrupt, RuntimeError) as error:
            raised = error
        if fault.fired and raised is None:
            raise AssertionError(f"{where}: the fault was swallowed; the call returned normally")
        engine.audit()
        if raised is not None:
            if operation.all_or_nothing:
                # A fault after the commit (delivering the call's events, as a listener's bug would) leaves it done.
                if (engine.tree(), engine.block_table(), engine.num_free_blocks) not in (before, expected.state):
                    raise AssertionError(f"{where}: the call raised and left the engine neither as it was nor as "
                                         f"the call leaves it")
            else:
                self._check_prefixes(engine, tokens_before, expected.tokens, where)
        self.check_logits(engine, where)
        live = [name for name, branch in engine.branches.items() if len(branch)]
        unconstrained = [name for name in live if engine.branch(name).matcher is None]
        engine.generate(unconstrained, 1, GREEDY)   # the next call works, reading every branch's KV
        engine.audit()
        self.check_logits(engine, where + ", after the next call")
        return fault.fired

    @staticmethod
    def _check_prefixes(engine: Engine, before: dict[str, list[int]], expected: dict[str, list[int]],
                        where: str) -> None:
        if set(engine.branches) != set(before):
            raise AssertionError(f"{where}: generate changed which branches exist")
        for name, branch in engine.branches.items():
            now, old, full = branch.tokens, before[name], expected[name]
            if now[:len(old)] != old or full[:len(now)] != now:
                raise AssertionError(f"{where}: branch {name!r} holds {now[len(old):]} after the fault, not a prefix "
                                     f"of the uninterrupted {full[len(old):]}")


def sweep(operations: list[Operation], lines_per_operation: int | None, seed: int = 0,
          exceptions: tuple[type[BaseException], ...] = (KeyboardInterrupt, RuntimeError),
          progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Inject at every traced line of each operation (lines_per_operation None) or at a seeded sample of that
    many. Returns the lines each operation executed. Raises AssertionError at the first damage found."""
    rng = random.Random(seed)
    runner = Sweep()
    counts = {}
    for operation in operations:
        expected = runner.baseline(operation)
        engine = runner.fresh(operation)
        total = count_lines(lambda: operation.run(engine))
        counts[operation.name] = total
        lines = list(range(1, total + 1))
        if lines_per_operation is not None and lines_per_operation < total:
            lines = sorted(rng.sample(lines, lines_per_operation))
        started = time.perf_counter()
        for exception in exceptions:
            for line in lines:
                runner.inject(operation, line, exception, expected)
        if progress:
            progress(f"{operation.name}: {total} lines, {len(lines)} x {len(exceptions)} faults, no damage "
                     f"({time.perf_counter() - started:.0f} s)")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=None, help="a seeded sample of this many lines per operation "
                                                                "(default: every line)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="operations whose name contains this text")
    args = parser.parse_args(argv)
    chosen = [op for op in OPERATIONS if args.only is None or args.only in op.name]
    torch.set_num_threads(1)   # a tiny model: threads only contend
    sweep(chosen, args.lines, args.seed, progress=lambda line: print(line, flush=True))
    print(f"{len(chosen)} operations swept: no damage", file=sys.stderr)


if __name__ == "__main__":
    main()
