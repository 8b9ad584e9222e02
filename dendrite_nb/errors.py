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
    """An operation that needs at least one token on the branch, and the hidden state after its last one (which a
    rewind into a run of tokens leaves unknown until the branch grows)."""


class ContextOverflow(DendriteError, ValueError):
    """A branch would grow past the model's maximum context."""


class OutOfBlocks(DendriteError, MemoryError):
    """The KV block pool cannot hold what was asked; nothing was changed."""

    def __init__(self, needed: int, free: int, what: str):
        self.needed, self.free = needed, free
        super().__init__(
            # The class's name leads the message: a magic shows the message alone, as a one-line UsageError.
            f"OutOfBlocks: {what} needs {needed:,} free KV blocks, the pool has {free:,}. "
            f"Prune branches you no longer need, or load the engine with a larger num_blocks."
        )


class CheckpointError(DendriteError, ValueError):
    """A checkpoint folder that is incomplete or inconsistent."""


class UnsupportedModel(CheckpointError):
    """A checkpoint whose architecture the engine does not implement."""


class ConstraintError(DendriteError, ValueError):
    """A constraint spec (JSON schema, regex, Lark grammar, choices) that is malformed."""


class ChatError(DendriteError, ValueError):
    """A chat message the model's chat template cannot take (a role it does not know, a conversation it
    refuses), or an engine without a chat template. Nothing was changed."""


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a listener raising KeyboardInterrupt) stopped generate at a step boundary.

    Every branch keeps the tokens of the steps that completed; `outputs` holds them per branch,
    in the order the branches were given.
    """

    def __init__(self, outputs: list[list[int]], steps_done: int, max_steps: int):
        self.outputs, self.steps_done, self.max_steps = outputs, steps_done, max_steps
        super().__init__(f"generation interrupted after {steps_done} of {max_steps} steps; every branch kept "
                         f"the tokens of the completed steps and the engine is ready for the next call.")

    def __str__(self) -> str:
        return str(self.args[0])


class TensorParallelError(DendriteError, RuntimeError):
    """Tensor parallelism that cannot run: a degree the model cannot be split by, an option it does not support at
    tensor_parallel > 1 yet, or a worker process that failed or died (the engine must then be closed and loaded
    again)."""


class SaveFileError(DendriteError, ValueError):
    """A save file that cannot be written (a folder in its place, a path that cannot be a file) or restored here:
    missing, truncated, corrupted, or saved with another model, dtype or block size. Nothing was changed."""


class ModelDownloadError(DendriteError):
    """The default model could not be fetched, or what was fetched failed its pinned checksum. Nothing was cached
    (a file that failed its checksum was deleted). `reason` says why, `remedy` how to get the model."""

    def __init__(self, model: str, reason: str, remedy: str):
        self.model, self.reason, self.remedy = model, reason, remedy
        super().__init__(f"cannot fetch {model}: {reason}. To get it, {remedy}.")

    def __str__(self) -> str:
        return str(self.args[0])
