"""The workloads of the llama.cpp comparison, each written once against systems.System and run unchanged on every
system: the same token ids, greedy, the same calls in the same order.

Each workload says what it times (its metrics, the first one the one settings are judged by), what one run must
at least compute (Forward lists, for the floors), and the llama.cpp context it needs (KV cells and sequence ids at
its peak). `prepare` does the untimed setup a run starts from (a document prefilled once); `run` is one timed
repetition and returns the wall seconds of each metric (and its CPU seconds, under key + "_cpu") and every token it
generated (to compare systems' outputs).

The scores that pick a tree's best node are placeholders for a value function (sum of the tokens mod 97, as in
benchmarks/tree_of_thought.py): cheap, deterministic and the same for every system. Greedy decoding makes forks of
one node generate the same tokens; the work (rows per step, contexts) is what a sampled search does.
"""
from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:   # annotations only: llama_worker.py runs workloads in a process without torch or the engine
    from .systems import System


class Forward(NamedTuple):
    """One forward pass that any system must run: `rows` sequences, each with `tokens` new tokens after `context`
    tokens it attends to."""

    rows: int
    tokens: int
    context: int


class Metric(NamedTuple):
    key: str
    label: str
    forwards: list[Forward]  # the least work that produces it, for its floor ([] : no floor, e.g. a fork)


@dataclass
class Texts:
    """Token ids every workload draws from, tokenized once by the engine's tokenizer."""

    document: list[int]  # real text (dendrite_nb.testing.corpus), cut to the longest document a workload uses
    instructions: list[list[int]]  # short distinct instructions for fan-out forks
    chat_prompt: list[int]  # one chat-formatted request (best-of-n, MCTS)
    moves: list[list[int]]  # short distinct tokens that start each MCTS expansion
    plan_prompts: list[list[int]]  # tree_of_thought_deep: the first user message per question, chat-formatted
    deep_segments: list[list[int]]  # tree_of_thought_deep: an answer's end and the next user message, levels 2..4


def score(tokens: list[int]) -> int:
    """Placeholder value function: the same for every system."""
    return sum(tokens) % 97


def flat(outputs: list[list[int]]) -> list[int]:
    return [token for row in outputs for token in row]


def decode_forwards(rows: int, new_tokens: int, context: int) -> list[Forward]:
    """The forwards that generate `new_tokens` greedily per row after a prefill whose logits give the first."""
    return [Forward(rows, 1, context + step) for step in range(new_tokens - 1)]


def cells_for(tokens: int) -> int:
    """llama.cpp n_ctx for a peak of `tokens` KV cells: rounded up to 256, with 256 to spare."""
    return 256 * math.ceil(tokens / 256) + 256


class Workload:
    name: str
    sweep = True  # run at every setting; False: once per system (the settings do not enter what it times)
    metrics: list[Metric]

    def cells(self) -> int: ...
    def sequences(self) -> int: ...

    def prepare(self, system: System) -> Any:
        return None

    def run(self, system: System, state: Any) -> tuple[dict[str, float], list[int]]: ...


class Clock(NamedTuple):
    """A moment by two clocks: wall time, and the CPU time of every thread of this process (both systems compute
    in this process). On a shared machine, wall time grows with others' load; CPU time much less."""

    wall: float
    cpu: float

    @classmethod
    def now(cls) -> Clock:
        return cls(time.perf_counter(), time.process_time())

    def figures(self, key: str, per: int = 1) -> dict[str, float]:
        """{key: wall seconds since this moment, key + "_cpu": CPU seconds since}, each divided by `per`."""
        wall, cpu = time.perf_counter(), time.process_time()
        return {key: (wall - self.wall) / per, f"{key}_cpu": (cpu - self.cpu) / per}


# ---- prefill ----------------------------------------------------------------------------------
class Prefill(Workload):
    def __init__(self, texts: Texts, tokens: int):
        self.ids = texts.document[:tokens]
        self.name = f"prefill, {len(self.ids)}-token document"
        self.metrics = [Metric("prefill", "prefill", [Forward(1, len(self.ids), 0)])]

    def cells(self) -> int:
        return cells_for(len(self.ids))

    def sequences(self) -> int:
        return 1

    def run(self, system, state):
        started = Clock.now()
        handle = system.root(self.ids)
        figures = started.figures("prefill")
        system.prune([handle])
        return figures, []


# ---- fork cost --------------------------------------------------------------------------------
@contextlib.contextmanager
def collector_off():
    """Python's garbage collector off inside the block (timed forks and prunes, as benchmarks/fork_cost.py times
    them: a collection walking the whole heap would land in one call at random)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class ForkCost(Workload):
    """Forks of one branch of `length` tokens, one call each, then their prunes; seconds per call. GC is off while
    timed, as in benchmarks/fork_cost.py. llama.cpp's context is sized for this branch alone: its seq_cp walks
    every cell of the cache."""

    sweep = False

    def __init__(self, texts: Texts, length: int, forks: int):
        self.ids, self.forks = texts.document[:length], forks
        self.name = f"fork cost, {forks} forks of a {len(self.ids):,}-token branch, one call each"
        self.metrics = [Metric("fork", f"fork, {len(self.ids):,}-token branch (per fork)", []),
                        Metric("prune", f"prune, {len(self.ids):,}-token branch (per prune)", [])]

    def cells(self) -> int:
        return cells_for(len(self.ids))

    def sequences(self) -> int:
        return 1 + self.forks

    def prepare(self, system):
        return system.root(self.ids)

    def run(self, system, root):
        with collector_off():
            started = Clock.now()
            kids = [system.fork(root, 1)[0] for _ in range(self.forks)]
            figures = started.figures("fork", per=self.forks)
            started = Clock.now()
            for kid in kids:
                system.prune([kid])
            figures |= started.figures("prune", per=self.forks)
        return figures, []


# ---- many forks, one step -----------------------------------------------------------------------
class ForkStep(Workload):
    """benchmarks/fork_decode.py's shape: `leaves` forks of a prefilled branch in one call, then the first decode
    step of all of them (System.step: each leaf's first token chosen from the branch's last logits and fed, one
    forward of `leaves` rows over the shared prefix), then their prunes. GC is off while the fork is timed."""

    def __init__(self, texts: Texts, prefix: int, leaves: int):
        self.ids, self.leaves = texts.document[:prefix], leaves
        self.name = f"{leaves:,} forks of a {len(self.ids):,}-token branch, then their first decode step"
        self.metrics = [Metric("step", f"first step, {leaves:,} leaves, {len(self.ids):,}-token prefix",
                               [Forward(leaves, 1, len(self.ids))]),
                        Metric("fork", f"fork x{leaves:,} (one call), {len(self.ids):,}-token branch", [])]

    def cells(self) -> int:
        return cells_for(len(self.ids) + 2 * self.leaves)

    def sequences(self) -> int:
        return 1 + self.leaves

    def prepare(self, system):
        return system.root(self.ids)

    def run(self, system, root):
        with collector_off():
            started = Clock.now()
            kids = system.fork(root, self.leaves)
            figures = started.figures("fork")
        started = Clock.now()
        tokens = system.step(kids)
        figures |= started.figures("step")
        system.prune(kids)
        return figures, tokens


# ---- fan-out ----------------------------------------------------------------------------------
class FanOut(Workload):
    """n forks of one prefilled document, each given its own short instruction (one extend call for all), then
    `tokens` greedy tokens on all of them together. Two timed runs per repetition, each from the fork: until every
    fork's first token exists, and until all `tokens` exist."""

    def __init__(self, texts: Texts, document: int, n: int, tokens: int):
        self.doc, self.n, self.tokens = texts.document[:document], n, tokens
        self.instructions = texts.instructions[:n]
        self.name = f"fan-out, {n} forks of a {len(self.doc)}-token document, {tokens} tokens each"
        instruction = round(sum(map(len, self.instructions)) / n)
        extend = Forward(n, instruction, len(self.doc))
        self.metrics = [
            Metric("all", f"fan-out {n}: all {tokens} tokens",
                   [extend] + decode_forwards(n, tokens, len(self.doc) + instruction)),
            Metric("first", f"fan-out {n}: first tokens", [extend])]

    def cells(self) -> int:
        return cells_for(len(self.doc) + sum(len(i) + self.tokens + 1 for i in self.instructions))

    def sequences(self) -> int:
        return self.n + 1

    def prepare(self, system):
        return system.root(self.doc)

    def once(self, system, doc, tokens, key):
        started = Clock.now()
        kids = system.fork(doc, self.n)
        system.extend(list(zip(kids, self.instructions)))
        outputs = system.generate(kids, tokens)
        figures = started.figures(key)
        system.prune(kids)
        return figures, outputs

    def run(self, system, doc):
        figures, _ = self.once(system, doc, 1, "first")
        more, outputs = self.once(system, doc, self.tokens, "all")
        return figures | more, flat(outputs)


# ---- tree of thought --------------------------------------------------------------------------
class TreeOfThought(Workload):
    """benchmarks/tree_of_thought.py's search at CPU scale: from a prompt (prefilled inside the timing), each level
    forks the best node into `width` children, generates `tokens` on them together, keeps the best and prunes the
    rest."""

    def __init__(self, texts: Texts, prompt: int, width: int, depth: int, tokens: int):
        self.prompt, self.width, self.depth, self.tokens = texts.document[:prompt], width, depth, tokens
        self.name = (f"tree of thought, width {width}, depth {depth}, {tokens} tokens a level, "
                     f"{len(self.prompt)}-token prompt")
        forwards = [Forward(1, len(self.prompt), 0)]
        for level in range(depth):
            # The kept node's last token is fed with the next level's first step: `tokens` steps after level 0.
            steps = tokens - 1 if level == 0 else tokens
            context = len(self.prompt) + level * tokens
            forwards += [Forward(width, 1, context + step) for step in range(steps)]
        self.metrics = [Metric("search", "tree of thought", forwards)]

    def cells(self) -> int:
        return cells_for(len(self.prompt) + self.depth * self.tokens + 2 * self.width * (self.tokens + 1))

    def sequences(self) -> int:
        return self.depth + self.width + 1

    def run(self, system, state):
        started = Clock.now()
        node = system.root(self.prompt)
        path, generated = [node], []
        for _ in range(self.depth):
            kids = system.fork(node, self.width)
            outputs = system.generate(kids, self.tokens)
            scores = [score(row) for row in outputs]
            best = scores.index(max(scores))
            system.prune([kid for i, kid in enumerate(kids) if i != best])
            node = kids[best]
            path.append(node)
            generated += outputs[best]
        figures = started.figures("search")
        system.prune(path)
        return figures, generated


# ---- best of n --------------------------------------------------------------------------------
class BestOfN(Workload):
    """One chat prompt (prefilled inside the timing), n forks, `tokens` greedy tokens on all of them together."""

    def __init__(self, texts: Texts, n: int, tokens: int):
        self.prompt, self.n, self.tokens = texts.chat_prompt, n, tokens
        self.name = f"best-of-{n}, {tokens} tokens each, {len(self.prompt)}-token prompt"
        self.metrics = [Metric("all", f"best-of-{n}",
                               [Forward(1, len(self.prompt), 0)] + decode_forwards(n, tokens, len(self.prompt)))]

    def cells(self) -> int:
        return cells_for(len(self.prompt) + self.n * (self.tokens + 1))

    def sequences(self) -> int:
        return self.n + 1

    def run(self, system, state):
        started = Clock.now()
        root = system.root(self.prompt)
        kids = system.fork(root, self.n)
        outputs = system.generate(kids, self.tokens)
        figures = started.figures("all")
        system.prune([root, *kids])
        return figures, flat(outputs)


class SteadyDecode(Workload):
    """benchmarks/tensor_parallel.py's step for llama.cpp: `leaves` forks of a `prefix`-token root, each extended by
    its own tokens, prefilled once (prepare); a run forks one copy of each leaf, times generate(copies, steps) and
    prunes the copies, so every run decodes from the same contexts (bench_common.generate_on_copies does the same
    to the engine). Its figure is seconds per decode: the call over its steps - 1 llama_decode calls (the first
    token comes from the logits of the leaf's prefill, and the last is left unfed: llama_cpp_peer.py). The engine's
    figure is its call over `steps`, as each of its steps runs a forward."""

    def __init__(self, prefix: list[int], own: list[list[int]], steps: int):
        if steps < 2:
            raise ValueError(f"steps must be at least 2 (a decode of each row needs a token to feed), got {steps}.")
        self.prefix, self.own, self.steps = prefix, own, steps
        self.name = f"decode step, {len(own)} leaves under {len(prefix):,} tokens"
        context = len(prefix) + len(own[0]) + steps // 2
        self.metrics = [Metric("step", "a decode step", [Forward(len(own), 1, context)])]

    def cells(self) -> int:
        return cells_for(len(self.prefix) + sum(len(ids) for ids in self.own) + len(self.own) * self.steps)

    def sequences(self) -> int:
        return 1 + 2 * len(self.own)

    def prepare(self, system):
        root = system.root(self.prefix)
        leaves = system.fork(root, len(self.own))
        system.extend(list(zip(leaves, self.own)))
        return leaves

    def run(self, system, leaves):
        copies = [system.fork(leaf, 1)[0] for leaf in leaves]
        started = Clock.now()
        outputs = system.generate(copies, self.steps)
        figures = started.figures("step", per=self.steps - 1)
        system.prune(copies)
        return figures, flat(outputs)


# ---- MCTS -------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Node:
    handle: Any
    parent: _Node | None
    children: list[_Node]
    visits: int = 0
    value_sum: float = 0.0


class Mcts(Workload):
    """Monte Carlo tree search over branches (the issue's full shape: 50 expansions, 1,000 rollouts of 50 tokens;
    `scale` shrinks the counts, not the lengths). From a chat prompt (prefilled inside the timing), each expansion
    selects a node by UCT (children per node at most `children`), forks it, extends the child with a short move
    marker and generates a `move`-token move; then `rollouts` forks of the child generate `rollout` tokens
    together, are scored and pruned, and the mean score is backed up the path."""

    CHILDREN, C_UCT = 3, 0.5

    def __init__(self, texts: Texts, expansions: int, rollouts: int, rollout: int, move: int):
        self.prompt, self.moves = texts.chat_prompt, texts.moves
        self.expansions, self.rollouts, self.rollout, self.move = expansions, rollouts, rollout, move
        self.name = (f"MCTS, {expansions} expansions of {move} tokens, {expansions * rollouts:,} rollouts of "
                     f"{rollout} tokens ({rollouts} per expansion, batched)")
        marker = round(sum(map(len, self.moves[:expansions])) / expansions)
        forwards = [Forward(1, len(self.prompt), 0)]
        for _ in range(expansions):
            # A node's depth is not known before the search runs: contexts are taken at depth 1 (a lower bound).
            context = len(self.prompt) + marker
            forwards += [Forward(1, marker, len(self.prompt))] + decode_forwards(1, move, context)
            forwards += [Forward(rollouts, 1, context + move + step) for step in range(rollout)]
        self.metrics = [Metric("search", "MCTS", forwards)]

    def cells(self) -> int:
        per_node = max(map(len, self.moves[:self.expansions])) + self.move + 2
        return cells_for(len(self.prompt) + self.expansions * per_node + self.rollouts * (self.rollout + 2))

    def sequences(self) -> int:
        return self.expansions + self.rollouts + 1

    def select(self, root: _Node) -> _Node:
        node = root
        while len(node.children) == self.CHILDREN:
            parent = node
            node = max(parent.children, key=lambda c: c.value_sum / c.visits
                       + self.C_UCT * math.sqrt(math.log(parent.visits) / c.visits))
        return node

    def run(self, system, state):
        started = Clock.now()
        root = _Node(system.root(self.prompt), None, [])
        nodes, generated = [root], []
        for index in range(self.expansions):
            leaf = self.select(root)
            (handle,) = system.fork(leaf.handle, 1)
            system.extend([(handle, self.moves[index])])
            (move,) = system.generate([handle], self.move)
            child = _Node(handle, leaf, [])
            leaf.children.append(child)
            nodes.append(child)
            rollouts = system.fork(handle, self.rollouts)
            outputs = system.generate(rollouts, self.rollout)
            system.prune(rollouts)
            value = sum(score(row) for row in outputs) / (96 * len(outputs))
            node = child
            while node is not None:
                node.visits += 1
                node.value_sum += value
                node = node.parent
            generated += move + outputs[0]
        figures = started.figures("search")
        system.prune([n.handle for n in nodes])
        return figures, generated


# ---- SGLang's tree_of_thought_deep ------------------------------------------------------------
class TreeOfThoughtDeep(Workload):
    """SGLang's benchmark/tree_of_thought_deep shape: per question, 4 chat turns (plan, execute, reflect, final
    answer); each turn's user message goes onto every state of the level before, each state then forks
    `branches` ways and each fork generates an answer, so the levels hold 2, 4, 8 and 16 answers per question
    (branches 2). Questions run together: one generate call per level for all of them. SGLang's answers are up to
    256 tokens at temperature ~0; here each is exactly `tokens` greedy tokens."""

    def __init__(self, texts: Texts, questions: int, branches: int, tokens: int):
        self.prompts, self.segments = texts.plan_prompts[:questions], texts.deep_segments
        self.questions, self.branches, self.tokens = questions, branches, tokens
        levels = 1 + len(self.segments)
        answers = sum(branches ** (level + 1) for level in range(levels)) * questions
        self.name = (f"tree_of_thought_deep (SGLang's shape), {questions} question{'s' if questions > 1 else ''}, "
                     f"{branches} branches x {levels} levels ({answers} answers of {tokens} tokens)")
        prompt = round(sum(map(len, self.prompts)) / questions)
        forwards = [Forward(questions, prompt, 0)]
        context = prompt
        for level in range(levels):
            rows = questions * branches ** (level + 1)
            if level:
                segment = len(self.segments[level - 1])
                forwards.append(Forward(rows // branches, segment + 1, context))   # + the last answer token
                context += segment + 1
            forwards += decode_forwards(rows, tokens, context)
            context += tokens - 1
        self.metrics = [Metric("search", "tree_of_thought_deep", forwards)]

    def cells(self) -> int:
        levels = 1 + len(self.segments)
        per_answer = self.tokens + 1 + max(map(len, self.segments), default=0) + 1
        answers = sum(self.branches ** (level + 1) for level in range(levels)) * self.questions
        return cells_for(sum(map(len, self.prompts)) + answers * per_answer)

    def sequences(self) -> int:
        levels = 1 + len(self.segments)
        return self.questions * (1 + sum(self.branches ** (level + 1) for level in range(levels)))

    def run(self, system, state):
        started = Clock.now()
        roots = [system.root(prompt) for prompt in self.prompts]
        states, every, generated = roots, list(roots), []
        for level in range(1 + len(self.segments)):
            if level:
                system.extend([(s, self.segments[level - 1]) for s in states])
            children = [kid for s in states for kid in system.fork(s, self.branches)]
            outputs = system.generate(children, self.tokens)
            generated += flat(outputs)
            states = children
            every += children
        figures = started.figures("search")
        system.prune(every)
        return figures, generated
