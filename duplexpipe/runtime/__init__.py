"""The runtime: executes one rank's instruction list over torch.distributed."""

from duplexpipe.runtime.config import EvalResult, GradsReadyHook, OverlapHook, RuntimeConfig, StepResult
from duplexpipe.runtime.executor import PipelineRuntime, default_overlap
from duplexpipe.runtime.timing import gather_timeline, merge_timelines
from duplexpipe.runtime.watchdog import (
    ActivationShapeError,
    HandshakeError,
    PeerFailedError,
    PipelineError,
    PipelineTimeoutError,
)

__all__ = [
    "ActivationShapeError",
    "EvalResult",
    "GradsReadyHook",
    "HandshakeError",
    "OverlapHook",
    "PeerFailedError",
    "PipelineError",
    "PipelineRuntime",
    "PipelineTimeoutError",
    "RuntimeConfig",
    "StepResult",
    "default_overlap",
    "gather_timeline",
    "merge_timelines",
]
