"""The paged, branching KV cache: block allocator, KV pool, node/branch tree."""
from .allocator import BlockAllocator
from .pool import KVPool
from .tree import AppendRecord, Branch, BranchTree, Node
from .tree_dump import SavedNode, TreeDump

__all__ = ["AppendRecord", "BlockAllocator", "Branch", "BranchTree", "KVPool", "Node", "SavedNode", "TreeDump"]
