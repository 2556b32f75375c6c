"""duplexpipe: pipeline-parallel training for PyTorch with schedules as data.

Everything a user needs imports from here: `from duplexpipe import Pipeline, PipelineConfig, run`. Drawing
lives in `duplexpipe.viz`, the MoE layer in `duplexpipe.moe`, the bundled GPT task in
`duplexpipe.launch.tasks.gpt`. Every name is loaded on first use from its one home (the table below), so
`import duplexpipe` (and the schedule tools, the CLI among them) stays light and `dir(duplexpipe)` shows the API.
"""

import typing as _typing

__version__ = "0.1.0"

_LAZY = (
    # schedules: build, check, time and compare (torch-free)
    ("Action", ("duplexpipe.schedules.ir", "Action")),
    ("Op", ("duplexpipe.schedules.ir", "Op")),
    ("Schedule", ("duplexpipe.schedules.ir", "Schedule")),
    ("StageInfo", ("duplexpipe.schedules.ir", "StageInfo")),
    ("load_json", ("duplexpipe.schedules.ir", "load_json")),
    ("save_json", ("duplexpipe.schedules.ir", "save_json")),
    ("load_torch_csv", ("duplexpipe.schedules.ir", "load_torch_csv")),
    ("save_torch_csv", ("duplexpipe.schedules.ir", "save_torch_csv")),
    ("Timeline", ("duplexpipe.schedules.timeline", "Timeline")),
    ("build_schedule", ("duplexpipe.schedules.registry", "build")),
    ("schedule_names", ("duplexpipe.schedules.registry", "names")),
    ("lower", ("duplexpipe.schedules.lower", "lower")),
    ("verify", ("duplexpipe.schedules.verify", "verify")),
    ("CostModel", ("duplexpipe.schedules.simulate", "CostModel")),
    ("simulate", ("duplexpipe.schedules.simulate", "simulate")),
    ("compare_schedules", ("duplexpipe.schedules.compare", "compare_schedules")),
    # planner (torch-free)
    ("PlanConfig", ("duplexpipe.planner.plan", "PlanConfig")),
    ("plan", ("duplexpipe.planner.plan", "plan")),
    ("Profile", ("duplexpipe.planner.profile", "Profile")),
    ("load_profile", ("duplexpipe.planner.profile", "load_profile")),
    ("save_profile", ("duplexpipe.planner.profile", "save_profile")),
    # configuration (torch-free)
    ("PipelineConfig", ("duplexpipe.config.pipeline", "PipelineConfig")),
    ("LossScaleConfig", ("duplexpipe.config.precision", "LossScaleConfig")),
    # training
    ("Pipeline", ("duplexpipe.train.trainer", "Pipeline")),
    ("StepInfo", ("duplexpipe.train.pipeline_config", "StepInfo")),
    ("plan_pipeline", ("duplexpipe.train.planning.auto", "plan_pipeline")),
    ("ZeroOptions", ("duplexpipe.dp_options.zero", "ZeroOptions")),
    ("compression_options", ("duplexpipe.dp_options.compression", "compression_options")),
    ("make_mesh", ("duplexpipe.parallel.mesh", "make_mesh")),
    ("profile_parts", ("duplexpipe.train.planning.measure", "profile_parts")),
    ("read_checkpoint", ("duplexpipe.train.checkpoint", "read_checkpoint")),
    # model -> parts
    ("Partition", ("duplexpipe.model.split", "Partition")),
    ("plan_partition", ("duplexpipe.model.split", "plan_partition")),
    ("split_model", ("duplexpipe.model.split", "split_model")),
    ("split_module", ("duplexpipe.model.trace_split", "split_module")),
    ("causal_lm_loss", ("duplexpipe.model.hf", "causal_lm_loss")),
    ("causal_lm_parts", ("duplexpipe.model.hf", "causal_lm_parts")),
    ("causal_lm_targets", ("duplexpipe.model.hf", "causal_lm_targets")),
    ("seeded_init", ("duplexpipe.model.stages", "seeded_init")),
    ("seeded_part", ("duplexpipe.model.stages", "seeded_part")),
    # runtime
    ("PipelineRuntime", ("duplexpipe.runtime.executor", "PipelineRuntime")),
    ("RuntimeConfig", ("duplexpipe.runtime.config", "RuntimeConfig")),
    # processes and the `duplexpipe train` loop
    ("run", ("duplexpipe.launch.processes", "run")),
    ("TrainTask", ("duplexpipe.launch.train_task", "TrainTask")),
    ("run_training", ("duplexpipe.launch.train_loop", "run_training")),
    ("TrainConfig", ("duplexpipe.launch.train_config", "TrainConfig")),
    # errors
    ("LaunchError", ("duplexpipe.errors", "LaunchError")),
    ("PeerFailedError", ("duplexpipe.errors", "PeerFailedError")),
    ("PipelineError", ("duplexpipe.errors", "PipelineError")),
    ("PipelineTimeoutError", ("duplexpipe.errors", "PipelineTimeoutError")),
    ("PlanError", ("duplexpipe.errors", "PlanError")),
    ("ScheduleError", ("duplexpipe.errors", "ScheduleError")),
)
"""Public name -> (its one home, the name there), in groups."""

__all__ = sorted(public for public, _ in _LAZY)

if _typing.TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from duplexpipe.config.pipeline import PipelineConfig
    from duplexpipe.config.precision import LossScaleConfig
    from duplexpipe.dp_options.compression import compression_options
    from duplexpipe.dp_options.zero import ZeroOptions
    from duplexpipe.errors import (
        LaunchError,
        PeerFailedError,
        PipelineError,
        PipelineTimeoutError,
        PlanError,
        ScheduleError,
    )
    from duplexpipe.launch.processes import run
    from duplexpipe.launch.train_config import TrainConfig
    from duplexpipe.launch.train_loop import run_training
    from duplexpipe.launch.train_task import TrainTask
    from duplexpipe.model.hf import causal_lm_loss, causal_lm_parts, causal_lm_targets
    from duplexpipe.model.split import Partition, plan_partition, split_model
    from duplexpipe.model.stages import seeded_init, seeded_part
    from duplexpipe.model.trace_split import split_module
    from duplexpipe.parallel.mesh import make_mesh
    from duplexpipe.planner.plan import PlanConfig, plan
    from duplexpipe.planner.profile import Profile, load_profile, save_profile
    from duplexpipe.runtime.config import RuntimeConfig
    from duplexpipe.runtime.executor import PipelineRuntime
    from duplexpipe.schedules.compare import compare_schedules
    from duplexpipe.schedules.ir import (
        Action,
        Op,
        Schedule,
        StageInfo,
        load_json,
        load_torch_csv,
        save_json,
        save_torch_csv,
    )
    from duplexpipe.schedules.lower import lower
    from duplexpipe.schedules.registry import build as build_schedule
    from duplexpipe.schedules.registry import names as schedule_names
    from duplexpipe.schedules.simulate import CostModel, simulate
    from duplexpipe.schedules.timeline import Timeline
    from duplexpipe.schedules.verify import verify
    from duplexpipe.train.checkpoint import read_checkpoint
    from duplexpipe.train.pipeline_config import StepInfo
    from duplexpipe.train.planning.auto import plan_pipeline
    from duplexpipe.train.planning.measure import profile_parts
    from duplexpipe.train.trainer import Pipeline

del _typing


def __getattr__(name: str) -> object:
    home = dict(_LAZY).get(name)
    if home is None:
        raise AttributeError(f"module 'duplexpipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home[0]), home[1])


def __dir__() -> list[str]:
    """The public API and the module's own dunder names (no helpers)."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})
