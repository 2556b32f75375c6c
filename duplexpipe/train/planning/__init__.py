"""The planning step before a Pipeline is built: `plan_pipeline` resolves a config (with schedule="auto": measures,
calibrates and plans) into the `PlannedPipeline` that `Pipeline(parts, loss_fn, optimizer, plan)` builds."""

from duplexpipe.train.planning.auto import PlannedPipeline, plan_pipeline

__all__ = ["PlannedPipeline", "plan_pipeline"]
