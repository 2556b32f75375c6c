"""The runtime: executes one rank's instruction list over torch.distributed."""

from duplexpipe.runtime.config import EvalResult, GradsReadyHook, RuntimeConfig, StepResult
from duplexpipe.runtime.executor import PipelineRuntime
from duplexpipe.runtime.timing import gather_timeline, merge_timelines

__all__ = [
    "EvalResult",
    "GradsReadyHook",
    "PipelineRuntime",
    "RuntimeConfig",
    "StepResult",
    "gather_timeline",
    "merge_timelines",
]
