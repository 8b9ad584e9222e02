"""Typed errors. Each message says what was wrong, what was expected, and what to do."""


class DendriteError(Exception):
    """Base class of every error the engine raises on purpose."""


class UnknownBranch(DendriteError, LookupError):
    """A branch name (or handle) that the engine does not hold."""

    def __str__(self) -> str:  # LookupError would quote the message like a dict key
        return str(self.args[0]) if self.args else ""


class BranchPruned(UnknownBranch):
    """A handle to a branch that has been pruned."""


class BranchExists(DendriteError, ValueError):
    """A new branch name that is already taken."""


class EmptyBranch(DendriteError, ValueError):
    """An operation that needs at least one token on the branch."""


class ContextOverflow(DendriteError, ValueError):
    """A branch would grow past the model's maximum context."""


class OutOfBlocks(DendriteError, MemoryError):
    """The KV block pool cannot hold what was asked; nothing was changed."""

    def __init__(self, needed: int, free: int, what: str):
        self.needed, self.free = needed, free
        super().__init__(
            f"OutOfBlocks: {what} needs {needed:,} free KV blocks, the pool has {free:,}. "
            f"Prune branches you no longer need, or load the engine with a larger num_blocks."
        )


class CheckpointError(DendriteError, ValueError):
    """A checkpoint folder that is incomplete or inconsistent."""


class UnsupportedModel(CheckpointError):
    """A checkpoint whose architecture the engine does not implement."""
