"""No leaks: random new/append/fork/generate/prune/preempt/save-restore sequences keep every invariant after every
step (generate also preempts by itself when the small pool cannot hold a step).

After each step: refcounts equal the references the tree holds, free + used = pool size, freed
blocks still carry their canaries, every branch holds exactly the tokens a shadow model predicts,
and a branch's next-token logits equal those of a fresh prefill of its tokens (so copy-on-write and
block reuse never corrupt what a branch reads). A save and restore swaps in an engine whose branches
give bit-identical logits. Pruning everything returns the pool to full.
"""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, precondition, rule

from dendrite_nb import Engine, OutOfBlocks, SamplingParams

from tests.support.engines import engine_state

NUM_BLOCKS = 40
tokens_strategy = st.lists(st.integers(min_value=3, max_value=250), min_size=1, max_size=9)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    engine = Engine.from_pretrained(checkpoint(), num_blocks=8)
    reference = Engine(engine.model, None, num_blocks=256, block_size=16)  # roomy, for fresh prefills
    return engine.model, engine.tokenizer, reference, engine.source


def test_random_operation_sequences_keep_invariants(loaded, tmp_path):
    model, tokenizer, reference, source = loaded

    class TreeMachine(RuleBasedStateMachine):
        branches = Bundle("branches")

        def __init__(self):
            super().__init__()
            # A fresh pool per example (the weights are shared), so a replayed failure is an exact rerun.
            self.engine = Engine(model, tokenizer, num_blocks=NUM_BLOCKS, block_size=4, debug=True)
            self.engine.source = source  # the weights are that checkpoint's, so a restore can rebuild them
            self.expected: dict[str, list[int]] = {}
            self.scored: dict[str, list[bool]] = {}  # which of each branch's tokens keep a log-probability
            # Every token sequence whose last token was ever scored. Prefix reuse shares the tree's nodes, and with
            # them the log-probabilities they keep (the values a scoring forward would give: the same tokens come
            # before), so a new branch or an append may find some of its tokens scored already, but only these.
            self.scored_prefixes: set[tuple[int, ...]] = set()
            self.counter = 0

        def _name(self):
            self.counter += 1
            return f"b{self.counter}"

        def _note_scored(self, name):
            tokens = self.expected[name]
            self.scored_prefixes.update(tuple(tokens[:i + 1]) for i, on in enumerate(self.scored[name]) if on)

        def _added_by_reuse(self, name, start):
            """The flags of the tokens a prefill without scoring just added from `start`: kept only where reused."""
            tokens, kept = self.expected[name], [lp is not None for lp in self.engine.logprobs(name)]
            for i in range(start, len(tokens)):
                assert not kept[i] or tuple(tokens[:i + 1]) in self.scored_prefixes, \
                    f"{name} keeps a log-probability at {i} that no scoring ever computed"
            return kept[start:]

        def _attempt(self, call):
            """Run a call that may legitimately run out of blocks; if it does, nothing may have changed."""
            before = engine_state(self.engine)
            try:
                return call()
            except OutOfBlocks:
                assert engine_state(self.engine) == before
                return None

        @rule(target=branches, tokens=tokens_strategy)
        def new_branch(self, tokens):
            name = self._name()
            if self._attempt(lambda: self.engine.new_branch(name, tokens)) is None:
                return None
            self.expected[name] = list(tokens)
            self.scored[name] = self._added_by_reuse(name, 0)
            return name

        @rule(name=branches, tokens=tokens_strategy, logprobs=st.booleans())
        def append(self, name, tokens, logprobs):
            if name in self.expected and self._attempt(lambda: self.engine.append(name, tokens, logprobs=logprobs)):
                start = len(self.expected[name])
                self.expected[name] += tokens
                if logprobs:  # a branch here is never empty, so all are scored; nothing is reused
                    self.scored[name] += [True] * len(tokens)
                    self._note_scored(name)
                else:
                    self.scored[name] += self._added_by_reuse(name, start)

        @rule(target=branches, name=branches, n=st.integers(1, 3))
        def fork(self, name, n):
            if name not in self.expected:
                return multiple()
            names = [self._name() for _ in range(n)]
            self.engine.fork(name, names=names)
            for child in names:
                self.expected[child] = list(self.expected[name])
                self.scored[child] = list(self.scored[name])
            return multiple(*names)

        @rule(names=st.lists(branches, min_size=1, max_size=3, unique=True), steps=st.integers(1, 4),
              temperature=st.sampled_from([0.0, 1.0]), logprobs=st.booleans())
        def generate(self, names, steps, temperature, logprobs):
            names = [n for n in names if n in self.expected]
            if not names:
                return
            sampling = SamplingParams(temperature=temperature, ignore_eos=True)
            outs = self._attempt(lambda: self.engine.generate(names, steps, sampling, logprobs=logprobs))
            for name, out in zip(names, outs or []):
                assert len(out) == steps
                self.expected[name] += out
                self.scored[name] += [logprobs] * steps
                self._note_scored(name)

        @rule(name=consumes(branches))
        def prune(self, name):
            if name in self.expected:
                self.engine.prune(name)
                del self.expected[name], self.scored[name]

        @rule(name=branches)
        def preempt(self, name):
            if name not in self.expected:
                return
            before = engine_state(self.engine)
            try:
                self.engine.preempt(name)
            except ValueError:  # shared or already preempted: refused, nothing changed
                assert engine_state(self.engine) == before

        @precondition(lambda self: self.expected)
        @rule()
        def save_and_restore(self):
            names = sorted(self.expected)
            before = self.engine.next_logits(names)
            restored = Engine.restore(self.engine.save(tmp_path / "session"))
            assert torch.equal(restored.next_logits(names), before)
            assert all(restored.logprobs(name) == self.engine.logprobs(name) for name in names)
            self.engine = restored  # not close(): that would free the weights the other examples share

        @precondition(lambda self: self.expected)
        @rule(data=st.data())
        def logits_match_a_fresh_prefill(self, data):
            name = data.draw(st.sampled_from(sorted(self.expected)))
            fresh = reference.new_branch("fresh", self.expected[name])
            try:
                diff = (self.engine.next_logits([name]) - reference.next_logits([fresh])).abs().max()
                # Decoding token by token and prefilling at once sum float32 GEMMs in different orders:
                # measured up to 1.03e-4 on logits of magnitude 10 (a 5-token branch, no fork needed).
                # Corrupted KV shows as diffs above 1 (skipping the copy-on-write copy gives 13.9).
                assert diff < 1e-3, f"branch {name} reads corrupted KV (max diff {diff})"
            finally:
                reference.prune(fresh)

        @invariant()
        def invariants_hold(self):
            self.engine.audit()  # refcounts == held, free + used == pool, canaries, node invariants
            assert {n: b.tokens for n, b in self.engine.branches.items()} == self.expected
            kept = {n: [lp is not None for lp in self.engine.logprobs(n)] for n in self.engine.branches}
            assert kept == self.scored
            used = len({b["id"] for b in self.engine.block_table()["blocks"]})
            assert used + self.engine.num_free_blocks == NUM_BLOCKS

        def teardown(self):
            self.engine.prune(list(self.engine.branches))
            assert self.engine.num_free_blocks == NUM_BLOCKS
            self.engine.audit()

    # filter_too_much: rules that draw from a still-empty bundle, or fail a precondition, are skipped, and
    # Hypothesis may count those draws as filtered inputs. Some random seeds make enough of them to fail that
    # health check (seen once in CI: 9 inputs generated, 50 filtered); the examples themselves are unchanged.
    TreeMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                                             print_blob=True)
    TreeMachine.TestCase().runTest()
