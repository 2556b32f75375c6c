"""Training: Pipeline and its config, checkpoints, precision, measuring a live model for the planner."""

from duplexpipe.train.measure import profile_parts
from duplexpipe.train.precision import DynamicLossScaler, LossScaleConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig, StepInfo

__all__ = ["DynamicLossScaler", "LossScaleConfig", "Pipeline", "PipelineConfig", "StepInfo", "profile_parts"]
