"""duplexpipe: pipeline-parallel training for PyTorch with schedules as data.

Everything a user needs imports from here: `from duplexpipe import Pipeline, PipelineConfig, run`. Drawing
lives in `duplexpipe.viz`, the MoE layer in `duplexpipe.moe`. Names that need torch are loaded on first use,
so `import duplexpipe` (and the schedule tools, the CLI among them) stays light.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from duplexpipe.schedules.ir import Action, Op, Schedule, ScheduleError, StageInfo, load_json, save_json
from duplexpipe.schedules.timeline import Event, Timeline

__version__ = "0.1.0"

_HOMES = {
    # schedules: build, check, time and compare (torch-free)
    "duplexpipe.schedules.ir": ("load_torch_csv", "save_torch_csv", "format_action", "parse_action"),
    "duplexpipe.schedules.registry": ("build_schedule=build", "schedule_names=names"),
    "duplexpipe.schedules.lower": ("lower",),
    "duplexpipe.schedules.verify": ("verify",),
    "duplexpipe.schedules.simulate": ("CostModel", "simulate"),
    "duplexpipe.schedules.compare": ("compare_rows", "compare_schedules"),
    # planner (torch-free)
    "duplexpipe.planner.plan": ("PlanConfig", "PlanError", "PlanResult", "plan"),
    "duplexpipe.planner.profile": ("Profile", "ProfileError", "load_profile", "save_profile"),
    "duplexpipe.planner.calibrate": ("fit_cost_model",),
    # runtime
    "duplexpipe.runtime.executor": ("PipelineRuntime",),
    "duplexpipe.runtime.config": ("EvalResult", "RuntimeConfig", "StepResult"),
    "duplexpipe.runtime.timing": ("gather_timeline",),
    "duplexpipe.runtime.pieces": ("LinkModel",),
    "duplexpipe.runtime.watchdog": ("ActivationShapeError", "HandshakeError", "PeerFailedError", "PipelineError",
                                    "PipelineTimeoutError"),
    "duplexpipe.comm.methods": ("compression_options",),
    "duplexpipe.comm.nonfinite": ("NonFiniteSendError",),
    # model -> parts
    "duplexpipe.model.split": ("PartInfo", "Partition", "plan_partition", "split_model"),
    "duplexpipe.model.trace_split": ("GraphPart", "split_module"),
    "duplexpipe.model.hf": ("causal_lm_loss", "causal_lm_parts", "causal_lm_targets"),
    "duplexpipe.model.stages": ("reset_parameters", "seeded_init", "seeded_part"),
    # data parallelism
    "duplexpipe.parallel.mesh": ("ParallelGroups", "make_mesh"),
    "duplexpipe.parallel.zero_config": ("ZeroOptions",),
    # training
    "duplexpipe.train.trainer": ("Pipeline", "PipelineConfig", "StepInfo"),
    "duplexpipe.train.precision": ("DynamicLossScaler", "LossScaleConfig"),
    "duplexpipe.train.measure": ("profile_parts",),
    "duplexpipe.train.checkpoint": ("read_checkpoint",),
    # processes and the `duplexpipe train` loop
    "duplexpipe.launch.processes": ("LaunchError", "init_from_env", "launch", "launched_by_torchrun", "run"),
    "duplexpipe.launch.train_loop": ("TrainResult", "TrainTask", "run_training"),
    "duplexpipe.launch.train_config": ("TrainConfig",),
    "duplexpipe.launch.tasks.gpt": ("CharCorpus", "GPTConfig", "build_gpt", "gpt_task", "lm_loss"),
}
"""Module -> the public names it holds ("public=own" where the module's own name differs)."""

_LAZY = MappingProxyType({
    public: (module, own or public)
    for module, names in _HOMES.items()
    for public, _, own in (name.partition("=") for name in names)
})

__all__ = sorted(["Action", "Event", "Op", "Schedule", "ScheduleError", "StageInfo", "Timeline", "load_json",
                  "save_json", *_LAZY])

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from duplexpipe.comm.methods import compression_options
    from duplexpipe.comm.nonfinite import NonFiniteSendError
    from duplexpipe.launch.processes import LaunchError, init_from_env, launch, launched_by_torchrun, run
    from duplexpipe.launch.tasks.gpt import CharCorpus, GPTConfig, build_gpt, gpt_task, lm_loss
    from duplexpipe.launch.train_config import TrainConfig
    from duplexpipe.launch.train_loop import TrainResult, TrainTask, run_training
    from duplexpipe.model.hf import causal_lm_loss, causal_lm_parts, causal_lm_targets
    from duplexpipe.model.split import PartInfo, Partition, plan_partition, split_model
    from duplexpipe.model.stages import reset_parameters, seeded_init, seeded_part
    from duplexpipe.model.trace_split import GraphPart, split_module
    from duplexpipe.parallel.mesh import ParallelGroups, make_mesh
    from duplexpipe.parallel.zero_config import ZeroOptions
    from duplexpipe.planner.calibrate import fit_cost_model
    from duplexpipe.planner.plan import PlanConfig, PlanError, PlanResult, plan
    from duplexpipe.planner.profile import Profile, ProfileError, load_profile, save_profile
    from duplexpipe.runtime.config import EvalResult, RuntimeConfig, StepResult
    from duplexpipe.runtime.executor import PipelineRuntime
    from duplexpipe.runtime.pieces import LinkModel
    from duplexpipe.runtime.timing import gather_timeline
    from duplexpipe.runtime.watchdog import (
        ActivationShapeError,
        HandshakeError,
        PeerFailedError,
        PipelineError,
        PipelineTimeoutError,
    )
    from duplexpipe.schedules.compare import compare_rows, compare_schedules
    from duplexpipe.schedules.ir import format_action, load_torch_csv, parse_action, save_torch_csv
    from duplexpipe.schedules.lower import lower
    from duplexpipe.schedules.registry import build as build_schedule
    from duplexpipe.schedules.registry import names as schedule_names
    from duplexpipe.schedules.simulate import CostModel, simulate
    from duplexpipe.schedules.verify import verify
    from duplexpipe.train.checkpoint import read_checkpoint
    from duplexpipe.train.measure import profile_parts
    from duplexpipe.train.precision import DynamicLossScaler, LossScaleConfig
    from duplexpipe.train.trainer import Pipeline, PipelineConfig, StepInfo


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'duplexpipe' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
