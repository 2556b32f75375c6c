"""The old home of the training API, kept so existing scripts work: each name is the same object as before.

Replaced by `duplexpipe` itself (`from duplexpipe import Pipeline, PipelineConfig, run, ...`) and the packages
`duplexpipe.model` (splitting), `duplexpipe.parallel` (mesh, data parallelism), `duplexpipe.train` (Pipeline,
precision, profiling) and `duplexpipe.launch` (processes).
"""

from duplexpipe.launch.processes import LaunchError, init_from_env, launch, launched_by_torchrun, run
from duplexpipe.model.split import PartInfo, Partition, plan_partition, split_model
from duplexpipe.model.stages import reset_parameters, seeded_init, seeded_part
from duplexpipe.model.trace_split import GraphPart, split_module
from duplexpipe.parallel.mesh import ParallelGroups, make_mesh
from duplexpipe.parallel.zero_config import ZeroOptions
from duplexpipe.train.measure import profile_parts
from duplexpipe.train.precision import DynamicLossScaler, LossScaleConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig, StepInfo

__all__ = [
    "DynamicLossScaler",
    "GraphPart",
    "LaunchError",
    "LossScaleConfig",
    "ParallelGroups",
    "PartInfo",
    "Partition",
    "Pipeline",
    "PipelineConfig",
    "StepInfo",
    "ZeroOptions",
    "init_from_env",
    "launch",
    "launched_by_torchrun",
    "make_mesh",
    "plan_partition",
    "profile_parts",
    "reset_parameters",
    "run",
    "seeded_init",
    "seeded_part",
    "split_model",
    "split_module",
]
