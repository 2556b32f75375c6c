"""The runtime: executes one rank's instruction list over torch.distributed."""

from duplexpipe.runtime.config import EvalResult, GradsReadyHook, OverlapHook, RuntimeConfig, StepResult
from duplexpipe.runtime.executor import PipelineRuntime, default_overlap
from duplexpipe.runtime.timing import gather_timeline, merge_timelines

__all__ = [
    "EvalResult",
    "GradsReadyHook",
    "OverlapHook",
    "PipelineRuntime",
    "RuntimeConfig",
    "StepResult",
    "default_overlap",
    "gather_timeline",
    "merge_timelines",
]
