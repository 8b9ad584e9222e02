"""dendrite-nb: a notebook-native LLM engine with a paged KV cache shaped like a tree.

    from dendrite_nb import Engine, SamplingParams
    eng = Engine.from_pretrained(path)

In a notebook: `%load_ext dendrite_nb`, then `%dendrite demo` (see dendrite_nb.magics).
"""
from .constraints import Constraint, parse_constraint
from .default_model import demo_model
from .engine import Engine
from .errors import (BranchExists, BranchPruned, ChatError, CheckpointError, ConstraintError, ContextOverflow,
                     DendriteError, EmptyBranch, GenerationInterrupted, ModelDownloadError, OutOfBlocks, SaveFileError,
                     TensorParallelError, UnknownBranch, UnsupportedModel)
from .events import DecodeStep, TreeChanged
from .engine.branch_state import Branch
from .model.quantized_linear import UnsupportedWeights
from .sampling import SamplingParams
from .step_history import StepHistory

__version__ = "0.1.0"
__all__ = ["Branch", "BranchExists", "BranchPruned", "ChatError", "CheckpointError", "Constraint", "ConstraintError",
           "ContextOverflow", "DecodeStep", "DendriteError", "EmptyBranch", "Engine", "GenerationInterrupted",
           "ModelDownloadError", "OutOfBlocks", "SamplingParams", "SaveFileError", "StepHistory", "TensorParallelError",
           "TreeChanged", "UnknownBranch", "UnsupportedModel", "UnsupportedWeights", "demo_model", "parse_constraint"]


def load_ipython_extension(ipython) -> None:
    """`%load_ext dendrite_nb`. The one place the engine package reaches the notebook layer, and only
    when IPython asks: importing dendrite_nb never imports IPython."""
    from dendrite_nb.magics import load_ipython_extension as load_magics

    load_magics(ipython)


def unload_ipython_extension(ipython) -> None:
    from dendrite_nb.magics import unload_ipython_extension as unload_magics

    unload_magics(ipython)
