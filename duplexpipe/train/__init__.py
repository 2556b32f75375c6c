"""Training: Pipeline and its config, the planning step before a Pipeline is built, checkpoints, precision."""

from duplexpipe.train.planning.measure import profile_parts
from duplexpipe.train.precision import DynamicLossScaler, LossScaleConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig, StepInfo

__all__ = ["DynamicLossScaler", "LossScaleConfig", "Pipeline", "PipelineConfig", "StepInfo", "profile_parts"]
