"""Every exception class of duplexpipe, in one torch-free module that every other module imports them from."""

from __future__ import annotations

__all__ = [
    "ActivationShapeError",
    "CheckpointError",
    "EveryStepSkipped",
    "FolderInUseError",
    "HandshakeError",
    "InputRejected",
    "LaunchError",
    "NonFiniteGradientError",
    "NonFiniteSendError",
    "PairAborted",
    "PeerFailedError",
    "PipelineError",
    "PipelineTimeoutError",
    "PlanError",
    "ProfileError",
    "RecomputeDone",
    "ScheduleError",
    "StoppedByPeer",
    "StructureError",
]


# ---------------------------------------------------------------- schedules, planner
class ScheduleError(ValueError):
    """A schedule (or a file holding one) is malformed, incomplete or deadlocks."""


class ProfileError(ValueError):
    """A profile file or object is malformed or does not fit what it is used for."""


class PlanError(ValueError):
    """No plan can be made: bad settings, a profile that does not fit, or a cap below every candidate."""

    def __init__(self, message: str, smallest_cap: float | None = None) -> None:
        super().__init__(message)
        self.smallest_cap = smallest_cap
        """With a cap below every candidate: the smallest cap some candidate fits (bytes)."""


# ---------------------------------------------------------------- what goes on the wire
class NonFiniteSendError(FloatingPointError):
    """A tensor sent through a codec held NaN or inf under the "raise" policy."""


class StructureError(ValueError):
    """A value is not a tensor or a (nested) tuple/list/dict of tensors with str keys."""


# ---------------------------------------------------------------- the runtime
class PipelineError(RuntimeError):
    """The pipeline runtime could not run a step (the message names the rank and action)."""


class PipelineTimeoutError(PipelineError, TimeoutError):
    """A bounded wait ran out: the message names the rank, the action and the peer."""


class PeerFailedError(PipelineError):
    """Another rank failed; this rank stopped. `failed_rank` is the rank that failed first."""

    def __init__(self, message: str, failed_rank: int) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class HandshakeError(PipelineError):
    """The ranks of a group do not run the same schedule (or a rank's stages are wrong)."""


class ActivationShapeError(PipelineError, ValueError):
    """A stage produced an activation whose shape or dtype differs from the announced one."""


class PairAborted(RuntimeError):
    """The other part of an F&B pair failed: this part stops at its next comm point."""


class RecomputeDone(Exception):
    """A checkpointed region's recompute has every saved tensor it needs: the rest of its forward is not run
    (`runtime.backward.checkpoint`; never leaves it)."""


# ---------------------------------------------------------------- training
class NonFiniteGradientError(FloatingPointError):
    """A training step's gradients held NaN or inf under PipelineConfig(nonfinite_grads="raise"): raised on every
    rank before the optimizer step, naming the step and the first stage and parameter that held one."""


class EveryStepSkipped(FloatingPointError):
    """Every optimizer step of a training run was skipped (its gradients held NaN or inf each time: a NaN weight or
    input, or fp16 loss scaling that cannot find a finite scale): the run trained nothing and exits non-zero."""


class CheckpointError(ValueError):
    """A checkpoint could not be read or written: not a checkpoint, incomplete, corrupt, changed since it was saved,
    unsafe to load, or a file operation failed (the message names the file and the cause)."""


# ---------------------------------------------------------------- processes
class LaunchError(RuntimeError):
    """A launched rank failed (or the launch timed out): `rank` names the rank whose own error
    caused it, `details` holds that rank's traceback, `summary` its error in one line, `errors` every
    failed rank's traceback."""

    def __init__(self, message: str, rank: int | None = None, details: str = "",
                 errors: dict[int, str] | None = None, summary: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details
        self.errors = dict(errors or {})
        self.summary = summary or (message.splitlines()[0] if message else "")
        self.output_log: str | None = None
        """The file that keeps the ranks' standard error when it holds what was not shown (None: nothing more)."""


class InputRejected(ValueError):
    """A configuration or input error found before training began (a bad flag, a checkpoint of another model):
    the command line prints its message in one line and exits 2, where an error during training exits 1."""


class FolderInUseError(ValueError):
    """A job's save or output folder is locked by another job that is still running (the message names its host
    and process id)."""


class StoppedByPeer(RuntimeError):
    """Under torchrun: this rank stopped only because rank `cause` failed, which reports the error (this rank
    logged one line naming it). `same_node`: the cause runs on this node (exit quietly with code 0)."""

    def __init__(self, rank: int, cause: int, same_node: bool) -> None:
        super().__init__(f"rank {rank} stopped because rank {cause} failed: see rank {cause}'s error")
        self.rank, self.cause, self.same_node = rank, cause, same_node
