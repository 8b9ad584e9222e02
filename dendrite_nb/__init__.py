"""dendrite-nb: a notebook-native LLM engine with a paged KV cache shaped like a tree.

    from dendrite_nb import Engine, SamplingParams
    eng = Engine.from_pretrained(path)
"""
from .engine import Engine
from .errors import (BranchExists, BranchPruned, CheckpointError, ContextOverflow, DendriteError, EmptyBranch,
                     OutOfBlocks, UnknownBranch, UnsupportedModel)
from .kv import Branch
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Branch", "BranchExists", "BranchPruned", "CheckpointError", "ContextOverflow", "DendriteError",
           "EmptyBranch", "Engine", "OutOfBlocks", "SamplingParams", "UnknownBranch", "UnsupportedModel"]
