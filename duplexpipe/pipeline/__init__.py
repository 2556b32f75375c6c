"""Model to stages, the training API and launch helpers."""

from duplexpipe.pipeline.dp.zero_options import ZeroOptions
from duplexpipe.pipeline.graph_split import GraphPart, split_module
from duplexpipe.pipeline.launch import LaunchError, init_from_env, launch, launched_by_torchrun, run
from duplexpipe.pipeline.mesh import ParallelGroups, make_mesh
from duplexpipe.pipeline.precision import DynamicLossScaler, LossScaleConfig
from duplexpipe.pipeline.profile import profile_parts
from duplexpipe.pipeline.split import PartInfo, Partition, plan_partition, split_model
from duplexpipe.pipeline.stages import reset_parameters, seeded_init, seeded_part
from duplexpipe.pipeline.trainer import Pipeline, PipelineConfig, StepInfo

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
