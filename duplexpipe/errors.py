"""Every exception class of duplexpipe, importable from here (a stub until the errors module moves in)."""

from duplexpipe.comm.nonfinite import NonFiniteSendError
from duplexpipe.launch.failures import InputRejected, StoppedByPeer
from duplexpipe.launch.processes import LaunchError
from duplexpipe.planner.plan import PlanError
from duplexpipe.planner.profile import ProfileError
from duplexpipe.runtime.pieces import PairAborted
from duplexpipe.runtime.structure import StructureError
from duplexpipe.runtime.watchdog import (
    ActivationShapeError,
    HandshakeError,
    PeerFailedError,
    PipelineError,
    PipelineTimeoutError,
)
from duplexpipe.schedules.ir import ScheduleError

__all__ = ["ActivationShapeError", "HandshakeError", "InputRejected", "LaunchError", "NonFiniteSendError",
           "PairAborted", "PeerFailedError", "PipelineError", "PipelineTimeoutError", "PlanError", "ProfileError",
           "ScheduleError", "StoppedByPeer", "StructureError"]
