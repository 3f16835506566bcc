"""colo's exceptions, all under ColoError. The compiled core raises the pool's by name (see csrc/bindings.cpp)."""


class ColoError(Exception):
    """Base of every exception colo defines (each also derives from the builtin it refines)."""


class OutOfMemoryError(ColoError, MemoryError):
    """A request does not fit the region's budget or free space, or the device has no memory left.

    The message names the region, the request, what is allocated and free, and the budget.
    A refused request changes nothing.
    """


class RegionAsleepError(ColoError, RuntimeError):
    """Allocation in a region whose physical memory is released; call `region.wake()` first."""


class EngineFailure(ColoError, RuntimeError):
    """The engine failed to generate, also after being rebuilt from the shared weights."""


class CheckpointError(ColoError, ValueError):
    """A checkpoint that cannot be read or does not belong to this kind of run."""


class ModelSaveError(CheckpointError):
    """Writing the model in Hugging Face format failed; every rank raises it together, and the run's
    checkpoints are as they were."""


class NonFiniteGradients(ColoError, ArithmeticError):
    """The gradient norm was not finite for as many steps in a row as the run allows; those steps did
    not touch the weights, and the last checkpoint is as it was."""


class EnvironmentFailed(ColoError, RuntimeError):
    """An agentic task's environment failed where the rollout cannot go on (its reset() raised, naming
    the dataset row); the run stops, its last checkpoint as it was."""


class Terminated(ColoError):
    """The run stopped at a step boundary because the process was asked to terminate (SIGTERM)."""
