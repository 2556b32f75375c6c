"""Data-parallel strategies: how a rank's gradients are reduced over its replicas and the optimizer stepped."""

from __future__ import annotations

import warnings

from duplexpipe.comm import NoCompression
from duplexpipe.pipeline.dp.base import DP_LANE, DPStrategy, LaneRecorder, OptimizerFactory, StrategyContext, WaitFn
from duplexpipe.pipeline.dp.buckets import DEFAULT_BUCKET_BYTES, BucketSpec, BucketTracker, final_order, plan_buckets
from duplexpipe.pipeline.dp.compressed import CompressedStrategy
from duplexpipe.pipeline.dp.replicated import ReplicatedStrategy

STRATEGY_NAMES = ("replicated", "compressed")
"""The names PipelineConfig.dp_strategy accepts (None picks one from grad_compression)."""

__all__ = [
    "DEFAULT_BUCKET_BYTES", "DP_LANE", "STRATEGY_NAMES", "BucketSpec", "BucketTracker", "CompressedStrategy",
    "DPStrategy", "LaneRecorder", "OptimizerFactory", "ReplicatedStrategy", "StrategyContext", "WaitFn",
    "check_strategy_name", "final_order", "make_strategy", "plan_buckets",
]


def check_strategy_name(name: str | None, compressing: bool) -> None:
    """Raise ValueError for an unknown strategy name, or one that cannot apply the requested compression."""
    if name is not None and name not in STRATEGY_NAMES:
        raise ValueError(f"unknown dp_strategy {name!r}; expected one of {STRATEGY_NAMES} or None")
    if name == "replicated" and compressing:
        raise ValueError("dp_strategy 'replicated' all-reduces exact gradients; with grad_compression set "
                         "use 'compressed' (or None)")


def make_strategy(ctx: StrategyContext, name: str | None = None) -> DPStrategy:
    """The strategy `name` (None: "compressed" when ctx.compression compresses, else "replicated").

    With one data-parallel replica there is nothing to reduce: compression is a no-op, said once in a
    warning, and the replicated strategy is used.
    """
    compressing = not isinstance(ctx.compression, NoCompression)
    check_strategy_name(name, compressing)
    name = name or ("compressed" if compressing else "replicated")
    if name == "compressed" and ctx.groups.dp_size == 1:
        warnings.warn(f"grad_compression={ctx.compression.method!r} has no effect with one data-parallel "
                      "replica (no gradients are reduced); training without compression", stacklevel=3)
        name = "replicated"
    if name == "compressed":
        return CompressedStrategy(ctx)
    return ReplicatedStrategy(ctx)
