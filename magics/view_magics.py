"""%tree, %blocks and %throughput: the session's live views of its engine (dendrite_nb.widgets), one of each per
engine."""
from __future__ import annotations

from IPython.core.magic import line_magic, magics_class

from .arguments import no_arguments
from .session import SessionBoundMagics


@magics_class
class ViewMagics(SessionBoundMagics):
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
        no_arguments("tree", line)
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
        no_arguments("blocks", line)
        return self.session.block_table_view()

    @line_magic
    def throughput(self, line: str = ""):
        """Decode throughput of the latest generation, live: tokens/s, step time and batch size per step.

        Usage: ``%throughput`` (no options)

        Examples::

          %gen root/* -n 64
          %throughput
        """
        no_arguments("throughput", line)
        return self.session.throughput_view()
