"""duplexpipe: pipeline-parallel training for PyTorch with schedules as data."""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from duplexpipe.schedules.ir import Action, Op, Schedule, ScheduleError, StageInfo
from duplexpipe.schedules.timeline import Event, Timeline

__version__ = "0.1.0"

# Names that need torch come from their modules on first use, so `import duplexpipe` (and the
# schedule tools, the CLI among them) stays light.
_LAZY = MappingProxyType({
    "build_schedule": ("duplexpipe.schedules.registry", "build"),
    "schedule_names": ("duplexpipe.schedules.registry", "names"),
    "lower": ("duplexpipe.schedules.lower", "lower"),
    "verify": ("duplexpipe.schedules.verify", "verify"),
    "CostModel": ("duplexpipe.schedules.simulate", "CostModel"),
    "simulate": ("duplexpipe.schedules.simulate", "simulate"),
    "PipelineRuntime": ("duplexpipe.runtime", "PipelineRuntime"),
    "RuntimeConfig": ("duplexpipe.runtime", "RuntimeConfig"),
    "StepResult": ("duplexpipe.runtime", "StepResult"),
    "EvalResult": ("duplexpipe.runtime", "EvalResult"),
    "gather_timeline": ("duplexpipe.runtime", "gather_timeline"),
    "Pipeline": ("duplexpipe.pipeline", "Pipeline"),
    "PipelineConfig": ("duplexpipe.pipeline", "PipelineConfig"),
    "split_model": ("duplexpipe.pipeline", "split_model"),
    "launch": ("duplexpipe.pipeline", "launch"),
    "run": ("duplexpipe.pipeline", "run"),
})

__all__ = [
    "Action", "CostModel", "EvalResult", "Event", "Op", "Pipeline", "PipelineConfig", "PipelineRuntime",
    "RuntimeConfig", "Schedule", "ScheduleError", "StageInfo", "StepResult", "Timeline", "build_schedule",
    "gather_timeline", "launch", "lower", "run", "schedule_names", "simulate", "split_model", "verify",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'duplexpipe' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
