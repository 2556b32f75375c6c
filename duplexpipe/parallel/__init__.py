"""Data parallelism: the mesh, gradient reduction strategies (replicated, compressed, ZeRO-1, ZeRO-2), tied weights."""

from duplexpipe.config.sections import DEFAULT_BUCKET_BYTES
from duplexpipe.parallel.buckets import BucketSpec, BucketTracker, final_order, plan_buckets
from duplexpipe.parallel.compressed import CompressedStrategy
from duplexpipe.parallel.factory import STRATEGY_NAMES, check_strategy_name, make_strategy
from duplexpipe.parallel.mesh import ParallelGroups, make_mesh
from duplexpipe.parallel.replicated import ReplicatedStrategy
from duplexpipe.parallel.strategy import DP_LANE, DPStrategy, LaneRecorder, OptimizerFactory, StrategyContext, WaitFn
from duplexpipe.parallel.zero1 import Zero1Strategy
from duplexpipe.parallel.zero2 import Zero2Strategy

__all__ = [
    "DEFAULT_BUCKET_BYTES", "DP_LANE", "STRATEGY_NAMES", "BucketSpec", "BucketTracker", "CompressedStrategy",
    "DPStrategy", "LaneRecorder", "OptimizerFactory", "ParallelGroups", "ReplicatedStrategy", "StrategyContext",
    "WaitFn", "Zero1Strategy", "Zero2Strategy", "check_strategy_name",
    "final_order", "make_mesh", "make_strategy", "plan_buckets",
]
