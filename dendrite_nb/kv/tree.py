"""Git for KV: immutable-once-shared token runs (nodes) and movable names (branches).

Plain Python, no torch: the engine moves tensors, this module decides which blocks hold which tokens.

- A node holds a run of tokens at positions [start, end) and the physical blocks for logical block
  indices start // block_size onward. When `start` is not block-aligned, the node's first block is a
  copy of its parent's partially filled tail block (copy-on-write at block granularity).
- A leaf's block table is its ancestors' tables with each child's blocks laid over the parent's tail.
- A node with children is frozen. A branch extends its node in place only when it is the node's sole
  name and the node is a leaf; otherwise an append creates a child and moves the branch onto it.
- Fork adds names to a node: O(1) in context length, no block touched.
- Every change logs how to undo it in the allocator's journal first (kv/journal.py), so a failed engine
  call puts the tree back as it was, whatever line the failure landed on.
- Every block is held by exactly one node. Prune collects the nodes no branch reaches; with `prefix_cache` on,
  it keeps those whose KV is in the pool as cache instead (kv/node_cache.py), evicted least recently used when
  an allocation needs their blocks. Reusing what the tree holds for a new prompt is kv/prefix.py's.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..errors import BranchExists, BranchPruned, OutOfBlocks, UnknownBranch
from ..wording import counted
from .allocator import BlockAllocator
from .journal import drop_keys, drop_members, restore_attrs, restore_key, restore_member
from .node_cache import NodeCache
from .tree_dump import SavedNode, TreeDump, check_dump


RECOMPUTE = "recompute"  # Node.swapped of a preempted node whose KV was dropped (to be recomputed), not copied


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _joined(items: list[Any]) -> str | None:
    """The items joined, or None unless every one is a str: one C loop, where an isinstance call per name costs
    5x more."""
    try:
        return "".join(items)
    except TypeError:
        return None


@dataclass(eq=False, slots=True)
class Node:
    id: int
    parent: Node | None
    start: int  # sequence position of this node's first token
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)
    branch_names: set[str] = field(default_factory=set)
    last_hidden: Any = None  # engine payload: the final hidden state after this node's last token
    # Ancestors-inclusive tokens and block table, kept only while frozen (a frozen node never changes).
    path_cache: dict[str, list[int]] = field(default_factory=dict)
    # Preempted: the node's KV lives outside the pool (engine payload `swapped`) and `blocks` is empty.
    # Only a childless node read by one branch is preempted, and it is resumed before anything appends to it.
    swapped_blocks: int = 0
    swapped: Any = None
    # A leaf's block table with the blocks it was built from: a leaf grows in place, and a decode step asks for
    # every leaf's table, so it is rebuilt only when the leaf's blocks change (once per block_size tokens).
    leaf_table: tuple[list[int], list[int]] | None = None
    # The model's log-probability of each token sampled by `generate(..., logprobs=True)`, by its index in
    # `tokens`; prompts, appends and tokens generated without logprobs have none.
    logprobs: dict[int, float] | None = None
    # The tree's clock (BranchTree.clock) when the node was made, matched by a prompt or grown by a decode step:
    # the cache evicts the least recently used first.
    last_use: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def keep_logprob(self, index: int, logprob: float) -> None:
        """Record the log-probability of tokens[index]."""
        if self.logprobs is None:
            self.logprobs = {}
        self.logprobs[index] = logprob

    def cut(self, num_tokens: int, num_blocks: int) -> None:
        """Keep only the first num_tokens tokens (and their log-probabilities) and num_blocks blocks: the undo of
        an append in place. The blocks' refcounts are the allocator's to restore."""
        del self.tokens[num_tokens:]
        del self.blocks[num_blocks:]
        if self.logprobs:
            self.logprobs = {i: lp for i, lp in self.logprobs.items() if i < num_tokens} or None


class Branch:
    """A named, movable pointer to a node. Handles go stale when the branch is pruned.

    This is all the tree needs of a branch. The engine's branches carry their decode state too (seed, sampler,
    grammar, priority, conversation) in a subclass (engine/branch_state.py) that the tree is built with."""

    __slots__ = ("name", "node", "_tree")

    def __init__(self, name: str, node: Node, tree: BranchTree):
        self.name, self.node, self._tree = name, node, tree

    @classmethod
    def forks(cls, names: list[str], node: Node, tree: BranchTree, parent: Branch) -> list[Branch]:
        """`cls(name, node, tree)` for each name, without an __init__ call per branch: making the branches is
        most of what a 1,000-child fork costs. A subclass with more state fills it from `parent` here."""
        new, children = object.__new__, []
        append = children.append
        for name in names:
            child = new(cls)
            child.name = name
            child.node = node
            child._tree = tree
            append(child)
        return children

    @property
    def tokens(self) -> list[int]:
        return list(self._tree.path_tokens(self.node))

    def __len__(self) -> int:
        return self.node.end

    def __bool__(self) -> bool:  # a handle is truthy even when the branch is still empty
        return True

    def __repr__(self) -> str:
        alive = self._tree.branches.get(self.name) is self
        return f"Branch({self.name!r}, {counted(self.node.end, 'token')}{'' if alive else ', pruned'})"


@dataclass(slots=True)
class AppendRecord:
    """What one append did, so the engine can write the KV and, if the forward fails, undo it."""

    branch: Branch
    from_node: Node  # the branch's node before the append
    node: Node  # the node the tokens went into
    created: bool  # node is a new child (else from_node was extended in place)
    old_num_tokens: int
    old_num_blocks: int
    cow: tuple[int, int] | None  # (src, dst) block to copy before writing, or None
    old_last_hidden: Any = None  # restored on undo of an in-place extension

    @property
    def positions(self) -> range:
        return range(self.node.start + self.old_num_tokens, self.node.end)


class BranchTree:
    def __init__(self, allocator: BlockAllocator, block_size: int, branch_type: type[Branch] = Branch):
        self.allocator, self.block_size = allocator, block_size
        self.branch_type = branch_type  # what add_branch and fork make: the engine's carries decode state
        self.journal = allocator.journal  # one undo log for the tree and the allocator: rolled back together
        self._next_node_id = 1
        self.root = Node(id=0, parent=None, start=0)
        self.branches: dict[str, Branch] = {}
        # Keep the nodes no branch reaches as cache (Engine.prefix_cache) instead of collecting them.
        self.prefix_cache = False
        self.cache = NodeCache(self.journal)
        self.clock = 0   # ticks once per use of nodes (Node.last_use): an append, a match, a decode step

    @property
    def num_available(self) -> int:
        """Blocks an allocation can have: the free ones, and those only cached nodes hold (evicted on demand)."""
        return self.allocator.num_free + self.cache.num_blocks

    def take_blocks(self, count: int, what: str) -> list[int]:
        """`count` blocks off the free list, evicting least recently used cached nodes first if the free ones are
        too few. Raises OutOfBlocks, changing nothing, when even evicting every cached node would not do."""
        if count > self.allocator.num_free:
            if count > self.num_available:
                raise OutOfBlocks(count, self.num_available, what)
            self.evict(count)
        return self.allocator.allocate(count, what)

    def evict(self, num_free: int) -> list[int]:
        """Evict cached nodes, least recently used leaves first, until `num_free` blocks are free (or the cache is
        empty). Returns the blocks freed."""
        freed: list[int] = []
        if self.allocator.num_free >= num_free:
            return freed
        for node in self.cache.least_recently_used():
            self.cache.remove(node)
            freed += self._detach(node)
            if self.allocator.num_free >= num_free:
                break
        return freed

    def drop_cache(self) -> list[int]:
        """Evict every cached node; returns the blocks freed."""
        freed: list[int] = []
        for node in sorted(self.cache.nodes, key=lambda n: -n.start):   # children first: each starts past its parent
            self.cache.remove(node)
            freed += self._detach(node)
        return freed

    # ---- lookup -------------------------------------------------------------------------------
    def resolve(self, branch: Branch | str) -> Branch:
        if isinstance(branch, Branch):
            if branch._tree is not self:
                raise UnknownBranch(f"this handle of branch {branch.name!r} belongs to another engine (one saved and "
                                    f"restored, say); pass the name {branch.name!r} instead.")
            if self.branches.get(branch.name) is not branch:
                raise BranchPruned(f"branch {branch.name!r} was pruned; fork a live branch or create a new one.")
            return branch
        if not isinstance(branch, str):
            raise TypeError(f"expected a Branch or a branch name, got {type(branch).__name__}")
        found = self.branches.get(branch)
        if found is None:
            names = ", ".join(sorted(self.branches)[:20]) or "none yet"
            raise UnknownBranch(f"no branch named {branch!r} (branches: {names}); create it with new_branch or fork.")
        return found

    def check_new_names(self, names: list[str]) -> set[str]:
        """Raise unless every name is a non-empty string that UTF-8 can write (a save file holds it), unused and
        given once; returns the names as a set. Every path that makes a branch name checks it here."""
        joined = _joined(names)
        unique = set(names) if joined is not None else None
        if unique is None or "" in unique:
            bad = next(name for name in names if not isinstance(name, str) or not name)
            raise ValueError(f"a branch name must be a non-empty string, got {bad!r}")
        try:
            joined.encode()  # one pass for all the names (a 1,000-child fork is a hot path); strict UTF-8 refuses
        except UnicodeEncodeError:  # exactly the surrogates, U+D800 to U+DFFF, paired or not
            bad = next(name for name in names if any("\ud800" <= char <= "\udfff" for char in name))
            char = next(char for char in bad if "\ud800" <= char <= "\udfff")
            raise ValueError(f"branch name {bad!r} holds {char!r}, a surrogate code point (half of a UTF-16 pair), "
                             f"which is not text: UTF-8 cannot write it, so no save could hold the branch. Use a "
                             f"name without it.") from None
        if not self.branches.keys().isdisjoint(unique):
            taken = [n for n in names if n in self.branches]
            raise BranchExists(f"branch {taken[0]!r} already exists; pick another name or prune it first.")
        if len(unique) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise BranchExists(f"name {dup!r} appears twice in one call; branch names must be unique.")
        return unique

    # ---- mutation -----------------------------------------------------------------------------
    def add_branch(self, name: str, node: Node | None = None, **state: Any) -> Branch:
        """A new branch at `node` (default: the empty root); `state` goes to the branch type's constructor."""
        self.check_new_names([name])
        node = node or self.root
        branch = self.branch_type(name, node, self, **state)
        self.journal.log(drop_keys, self.branches, [name])
        self.journal.log(drop_members, node.branch_names, {name})
        node.branch_names.add(name)
        self.branches[name] = branch
        return branch

    def _extends_in_place(self, branch: Branch) -> bool:
        node = branch.node
        return (node is not self.root and not node.children and len(node.branch_names) == 1
                and branch.name in node.branch_names)

    def _needed(self, node: Node, in_place: bool, num_tokens: int) -> int:
        """Blocks to take from the free list: a preempted node's own come back first."""
        size, end = self.block_size, node.start + len(node.tokens)
        held = len(node.blocks) + node.swapped_blocks
        if in_place:
            return node.swapped_blocks + max(0, -(-(end + num_tokens) // size) - node.start // size - held)
        return node.swapped_blocks + -(-(end + num_tokens) // size) - end // size

    def blocks_needed(self, branch: Branch, num_tokens: int) -> int:
        """Free blocks an append of `num_tokens` would take (copy-on-write copy included)."""
        return self._needed(branch.node, self._extends_in_place(branch), num_tokens)

    # ---- preemption ---------------------------------------------------------------------------
    def preemptible(self, branch: Branch) -> int:
        """Blocks that preempting `branch` would free: its leaf node's, when nothing else reads them."""
        node = branch.node
        if node is self.root or node.children or node.branch_names != {branch.name}:
            return 0
        return len(node.blocks)

    def preempt(self, branch: Branch) -> list[int]:
        """Give the branch's leaf blocks back (the caller copied their KV out first); returns them."""
        node = branch.node
        if not self.preemptible(branch):
            raise RuntimeError(f"branch {branch.name!r} has no blocks of its own to preempt")
        self.journal.log(restore_attrs, node, {"blocks": node.blocks, "swapped_blocks": node.swapped_blocks})
        freed, node.blocks, node.swapped_blocks = node.blocks, [], len(node.blocks)
        self.allocator.decref(freed)
        return freed

    def resume(self, node: Node) -> list[int]:
        """Blocks for a preempted node again (the caller copies its KV back in). Raises OutOfBlocks first."""
        blocks = self.take_blocks(node.swapped_blocks, "resuming a branch")
        self.journal.log(restore_attrs, node, {"blocks": node.blocks, "swapped_blocks": node.swapped_blocks})
        node.blocks, node.swapped_blocks = blocks, 0
        return node.blocks

    def append(self, branch: Branch, tokens: list[int]) -> AppendRecord:
        """Put `tokens` on the branch; allocates blocks. Raises OutOfBlocks before changing anything."""
        records: list[AppendRecord] = []
        self.journal.log(self._undo_appends, records)
        self._append(branch, tokens, records)
        return records[0]

    def _append(self, branch: Branch, tokens: list[int], records: list[AppendRecord]) -> None:
        """append(), with its record put in `records` before anything changes (a logged undo reads them)."""
        node, size = branch.node, self.block_size
        if node.swapped_blocks:
            raise RuntimeError(f"branch {branch.name!r} is preempted; resume it before appending")
        in_place = self._extends_in_place(branch)
        needed = self._needed(node, in_place, len(tokens))
        if needed > self.allocator.num_free and needed > self.num_available:   # the message only when needed (hot)
            raise OutOfBlocks(needed, self.num_available, f"appending {len(tokens):,} tokens to {branch.name!r}")
        self.clock += 1
        if in_place:
            records.append(AppendRecord(branch, node, node, False, len(node.tokens), len(node.blocks), None,
                                        node.last_hidden))
            new_blocks = self.take_blocks(needed, "an append") if needed else []
            node.tokens.extend(tokens)
            node.blocks.extend(new_blocks)
            node.last_use = self.clock
            return
        new_blocks = self.take_blocks(needed, "an append")
        start = node.end
        cow = (self.block_table(node)[start // size], new_blocks[0]) if start % size else None
        child = Node(id=self._next_node_id, parent=node, start=start, tokens=list(tokens), blocks=new_blocks,
                     last_use=self.clock)
        self._next_node_id += 1
        records.append(AppendRecord(branch, node, child, True, 0, 0, cow))
        node.children.append(child)
        self._move(branch, child)

    def append_one_each(self, branches: list[Branch], token: int) -> list[AppendRecord]:
        """`append(branch, [token])` for each branch in order, as a decode step does. A leaf that its branch
        alone names and whose last block has room (15 steps of 16) takes the token right here; the others go
        through append. One journal entry undoes them all; on failure they are undone and nothing changed."""
        records: list[AppendRecord] = []
        mark = self.journal.mark()
        self.journal.log(self._undo_appends, records)
        size, root = self.block_size, self.root
        self.clock += 1
        now = self.clock
        try:
            for branch in branches:
                node = branch.node
                tokens = node.tokens
                # Inline, for speed: not _extends_in_place(branch), or _needed(node, True, 1) > 0 (with swapped).
                if (node is root or node.children or node.swapped_blocks or len(node.branch_names) != 1
                        or branch.name not in node.branch_names
                        or -(-(node.start + len(tokens) + 1) // size) - node.start // size > len(node.blocks)):
                    self._append(branch, [token], records)
                    continue
                records.append(AppendRecord(branch, node, node, False, len(tokens), len(node.blocks), None,
                                            node.last_hidden))
                tokens.append(token)
                node.last_use = now
        except BaseException:   # all or nothing on its own too (a row that finds no block undoes the others)
            self.journal.rollback(mark)
            raise
        return records

    def _undo_appends(self, records: list[AppendRecord]) -> None:
        for record in reversed(records):
            self.undo(record)

    def undo(self, record: AppendRecord) -> None:
        """Revert one append, however far it got (the journal calls this; the allocator's own entries give
        the blocks back). The KV written is simply dropped."""
        node = record.node
        if record.created:
            branch, parent = record.branch, record.from_node
            node.branch_names.discard(branch.name)
            parent.branch_names.add(branch.name)
            branch.node = parent
            self._unlink(parent, node)
        else:
            node.cut(record.old_num_tokens, record.old_num_blocks)
            node.last_hidden = record.old_last_hidden

    @staticmethod
    def _unlink(parent: Node, child: Node) -> None:
        if child in parent.children:
            parent.children.remove(child)
        if not parent.children:
            parent.path_cache.clear()  # a leaf again: it may be extended, so its paths may change

    def _relink(self, parent: Node, index: int, child: Node, fields: dict[str, Any]) -> None:
        """Undo of _detach: the child back in its place under its parent, with what it held."""
        restore_attrs(child, fields)
        if child not in parent.children:
            parent.children.insert(index, child)

    def fork(self, branch: Branch, names: list[str]) -> list[Branch]:
        """New names on the branch's node: O(1) in context length. The branch type fills each child's own
        state from the parent (Branch.forks)."""
        unique = self.check_new_names(names)
        node = branch.node
        children = self.branch_type.forks(names, node, self, branch)
        self.journal.log(drop_keys, self.branches, names)
        self.journal.log(drop_members, node.branch_names, unique)
        node.branch_names |= unique
        self.branches.update(zip(names, children))
        return children

    def prune(self, branch: Branch) -> list[int]:
        """Remove the name; collect nodes nothing reaches (or, with prefix_cache on, keep them as cache). Returns
        the blocks that were freed."""
        self.journal.log(restore_key, self.branches, branch.name, branch, True)
        self.journal.log(restore_member, branch.node.branch_names, branch.name, True)
        del self.branches[branch.name]
        branch.node.branch_names.discard(branch.name)
        return self.release(branch.node)

    def release(self, node: Node) -> list[int]:
        """After `node` lost a branch name: from it up, collect each node that no branch reaches any more, or, with
        prefix_cache on, keep it as cache (a preempted one, whose KV is out of the pool, is collected). Returns the
        blocks freed."""
        freed: list[int] = []
        cache = self.cache
        while node is not self.root and not node.branch_names:
            parent = node.parent
            if self.prefix_cache and not node.swapped_blocks:
                if not all(child in cache for child in node.children):
                    break
                cache.add(node)
            elif node.children:
                break
            else:
                freed += self._detach(node)
            node = parent
        return freed

    def move(self, branch: Branch, node: Node) -> None:
        """Point the branch at another node (logged: a failed call moves it back)."""
        self.journal.log(self._move_back, branch, branch.node, node)
        self._move(branch, node)

    @staticmethod
    def _move_back(branch: Branch, old: Node, new: Node) -> None:
        """Undo of move: the branch on `old` again, however far the move got."""
        new.branch_names.discard(branch.name)
        old.branch_names.add(branch.name)
        branch.node = old

    def _move(self, branch: Branch, node: Node) -> None:
        branch.node.branch_names.discard(branch.name)
        node.branch_names.add(branch.name)
        branch.node = node

    def _detach(self, node: Node) -> list[int]:
        parent = node.parent
        self.journal.log(self._relink, parent, parent.children.index(node), node,
                         {"blocks": node.blocks, "parent": parent, "last_hidden": node.last_hidden,
                          "leaf_table": node.leaf_table, "swapped": node.swapped,
                          "swapped_blocks": node.swapped_blocks})
        self._unlink(parent, node)
        freed = self.allocator.decref(node.blocks)
        node.blocks, node.parent, node.last_hidden, node.leaf_table = [], None, None, None
        node.swapped, node.swapped_blocks = None, 0
        return freed

    # ---- as plain data (a save file) -------------------------------------------------------------
    def dump(self) -> tuple[TreeDump, list[Node]]:
        """The tree as plain data, and the live nodes it lists, in the same order (root and cached nodes left out),
        so the caller can save what the engine hangs on them (last_hidden, swapped)."""
        cache = self.cache   # cached nodes are left out: no branch reaches them (and none of their parents is)
        nodes = [node for node in self.nodes() if node is not self.root and node not in cache]
        index = {id(node): i for i, node in enumerate(nodes)}
        saved = [SavedNode(id=node.id, parent=-1 if node.parent is self.root else index[id(node.parent)],
                           start=node.start, tokens=list(node.tokens), blocks=list(node.blocks),
                           preempted=node.swapped_blocks, logprobs=dict(node.logprobs or {})) for node in nodes]
        branches = {name: index.get(id(branch.node), -1) for name, branch in self.branches.items()}
        return TreeDump(saved, branches, self._next_node_id), nodes

    def load(self, dump: TreeDump, branch_state: Mapping[str, Mapping[str, Any]] | None = None) -> list[Node]:
        """Make the dumped nodes and branches in this empty tree; returns the nodes, in the dump's order, for the
        caller to hang its payloads on (branches: `self.branches[name]`). The blocks the dump holds must be
        allocated already, one reference per node that holds them (the caller copies their KV in). Each branch
        is `branch_type(name, node, tree, **branch_state[name])`. Raises ValueError, changing nothing, for a
        dump that would not make a tree audit() accepts (kv/tree_dump.py)."""
        branch_state = branch_state or {}
        check_dump(self, dump, branch_state)
        nodes: list[Node] = []
        for saved in dump.nodes:   # new objects only, until every branch is made: a failing constructor changes nothing
            parent = self.root if saved.parent < 0 else nodes[saved.parent]
            node = Node(id=saved.id, parent=parent, start=saved.start, tokens=list(saved.tokens),
                        blocks=list(saved.blocks), swapped_blocks=saved.preempted,
                        logprobs=dict(saved.logprobs) or None)
            if parent is not self.root:
                parent.children.append(node)
            nodes.append(node)
        branches = [self.branch_type(name, self.root if index < 0 else nodes[index], self, **branch_state.get(name, {}))
                    for name, index in dump.branches.items()]
        self.journal.log(self._unload, self._next_node_id)
        self.root.children.extend(node for node in nodes if node.parent is self.root)
        for branch in branches:
            branch.node.branch_names.add(branch.name)
            self.branches[branch.name] = branch
        self._next_node_id = dump.next_node_id
        return nodes

    def _unload(self, next_node_id: int) -> None:
        """Undo of load: the tree empty again (load takes only an empty one)."""
        self.root.children.clear()
        self.root.branch_names.clear()
        self.root.path_cache.clear()
        self.branches.clear()
        self._next_node_id = next_node_id

    # ---- derived views ------------------------------------------------------------------------
    def _path(self, node: Node, key: str) -> list[int]:
        chain = []
        while node is not self.root and key not in node.path_cache:
            chain.append(node)
            node = node.parent
        acc: list[int] = [] if node is self.root else node.path_cache[key]
        for node in reversed(chain):
            if key == "tokens":
                acc = acc + node.tokens
            else:  # the block table: the child's first block replaces the parent's partial tail
                acc = acc[: node.start // self.block_size] + node.blocks
            if node.children:
                node.path_cache[key] = acc
        return acc

    def path_logprobs(self, node: Node) -> list[float | None]:
        """The sampled log-probability of each token from the root to `node` (None where none was kept)."""
        chain = []
        while node is not self.root:
            chain.append(node)
            node = node.parent
        out: list[float | None] = []
        for node in reversed(chain):
            kept = node.logprobs or {}
            out.extend(kept.get(i) for i in range(len(node.tokens)))
        return out

    def path_tokens(self, node: Node) -> list[int]:
        """All tokens from the root to the end of `node`. Do not mutate the result."""
        return self._path(node, "tokens")

    def block_table(self, node: Node) -> list[int]:
        """Physical block per logical block index for the sequence ending at `node`. Do not mutate."""
        if node.children or node is self.root:
            return self._path(node, "table")
        # A leaf's table is its (frozen) ancestors' with its own blocks laid over their tail, so equal own
        # blocks mean an equal table (whatever happened between: undo, preemption, resumption).
        cached = node.leaf_table
        if cached is not None and cached[0] == node.blocks:
            return cached[1]
        table = self._path(node, "table")
        node.leaf_table = (list(node.blocks), table)
        return table

    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def audit(self) -> None:
        """Check every invariant of the tree and the pool; raises AssertionError naming the first failures."""
        held: Counter[int] = Counter()
        problems = self._audit_cache()
        for node in self.nodes():
            held.update(node.blocks)
            if node is self.root:
                continue
            expected = _ceil_div(node.end, self.block_size) - node.start // self.block_size
            if node.swapped_blocks and (node.blocks or node.children):
                problems.append(f"preempted node {node.id} holds blocks or has children")
            if len(node.blocks) + node.swapped_blocks != expected:
                problems.append(f"node {node.id} holds {len(node.blocks)} blocks for {len(node.tokens)} tokens")
            if node.start != node.parent.end:
                problems.append(f"node {node.id} starts at {node.start}, its parent ends at {node.parent.end}")
            if not node.branch_names and not node.children and node not in self.cache:
                problems.append(f"node {node.id} is unreachable but was not collected")
            if node.logprobs and not all(0 <= i < len(node.tokens) for i in node.logprobs):
                problems.append(f"node {node.id} holds log-probabilities past its {len(node.tokens)} tokens")
        for name, branch in self.branches.items():
            if name not in branch.node.branch_names or (branch.node is not self.root and branch.node.parent is None):
                problems.append(f"branch {name!r} points at a detached node")
        if problems:
            raise AssertionError("tree audit failed: " + "; ".join(problems[:10]))
        self.allocator.audit(held)

    def _audit_cache(self) -> list[str]:
        """The cache holds exactly the nodes no branch reaches (none while prefix_cache is off), each in the tree
        with its KV in the pool, and counts their blocks right."""
        order = list(self.nodes())
        reached: dict[int, bool] = {}
        for node in reversed(order):   # children before their parents
            reached[id(node)] = bool(node.branch_names) or any(reached[id(child)] for child in node.children)
        problems = []
        in_tree = {id(node) for node in order}
        for node in self.cache.nodes:
            if id(node) not in in_tree or reached[id(node)] or node.swapped_blocks:
                problems.append(f"cached node {node.id} is detached, reached by a branch or preempted")
        unreached = [node for node in order[1:] if not reached[id(node)] and node not in self.cache]
        problems += [f"node {node.id} is unreachable but was not collected" for node in unreached if node.children]
        if self.cache.nodes and not self.prefix_cache:
            problems.append(f"{len(self.cache.nodes)} nodes are cached while prefix_cache is off")
        if self.cache.num_blocks != sum(len(node.blocks) for node in self.cache.nodes):
            problems.append(f"the cache counts {self.cache.num_blocks} blocks but its nodes hold "
                            f"{sum(len(node.blocks) for node in self.cache.nodes)}")
        return problems
