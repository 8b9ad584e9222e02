"""Counts in what users read say "1 block" and "2 blocks", never "1 blocks"."""
import pytest

from dendrite_nb.widgets.tree_view import tree_lines
from dendrite_nb.wording import counted


@pytest.mark.parametrize("count, noun, text", [
    (0, "block", "0 blocks"), (1, "block", "1 block"), (2, "block", "2 blocks"),
    (1, "branch", "1 branch"), (3, "branch", "3 branches"), (1_024, "KV block", "1,024 KV blocks"),
    (1, "copy-on-write copy", "1 copy-on-write copy"), (2, "copy-on-write copy", "2 copy-on-write copies"),
])
def test_counted_puts_the_noun_in_the_number_the_count_needs(count, noun, text):
    assert counted(count, noun) == text


def test_a_one_token_node_of_one_block_reads_in_the_singular(engine):
    root = engine.new_branch("root", [5, 6, 7])
    engine.fork(root, names=["a"])
    engine.append(root, [8])
    lines = tree_lines(engine.tree())
    assert any("+1 token at 3, 1 block [root]" in line for line in lines), lines
