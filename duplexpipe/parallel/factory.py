"""Choosing the data-parallel strategy from the configuration (replicated, compressed, ZeRO-1, ZeRO-2, ZeRO-3)."""

from __future__ import annotations

import warnings
from dataclasses import replace

from duplexpipe.config.sections import STRATEGY_NAMES as STRATEGY_NAMES
from duplexpipe.config.sections import check_strategy_name as check_strategy_name
from duplexpipe.dp_options.compression import NoCompression
from duplexpipe.dp_options.zero import ZeroOptions, check_zero
from duplexpipe.parallel.compressed import CompressedStrategy
from duplexpipe.parallel.replicated import ReplicatedStrategy
from duplexpipe.parallel.strategy import DPStrategy, StrategyContext
from duplexpipe.parallel.zero1 import Zero1Strategy
from duplexpipe.parallel.zero2 import Zero2Strategy
from duplexpipe.parallel.zero3 import Zero3Strategy


def make_strategy(ctx: StrategyContext, name: str | None = None) -> DPStrategy:
    """The strategy `name` (None: "compressed" when ctx.compression compresses, else "replicated").

    With one data-parallel replica there is nothing to reduce: compression is a no-op, said once in a
    warning, and the replicated strategy is used.
    """
    compressing = not isinstance(ctx.compression, NoCompression)
    if ctx.zero_stage:
        return _zero_strategy(ctx, name)
    check_strategy_name(name, compressing)
    name = name or ("compressed" if compressing else "replicated")
    if name == "compressed" and ctx.groups.dp_size == 1:
        warnings.warn(f"grad_compression={ctx.compression.method!r} has no effect with one data-parallel "
                      "replica (no gradients are reduced); training without compression", stacklevel=3)
        name = "replicated"
    if name == "compressed":
        return CompressedStrategy(ctx)
    return ReplicatedStrategy(ctx)


def _zero_strategy(ctx: StrategyContext, name: str | None) -> DPStrategy:
    """ZeRO-1, 2 or 3 (with one replica there is nothing to shard: the replicated strategy, with a warning)."""
    check_zero(ctx.zero_stage, ctx.zero, ctx.compression, name)
    if ctx.groups.dp_size == 1:
        warnings.warn(f"zero_stage={ctx.zero_stage} (and its gradient compression) has no effect with one "
                      "data-parallel replica (nothing to shard); training with the replicated strategy", stacklevel=3)
        return ReplicatedStrategy(replace(ctx, zero_stage=0, zero=ZeroOptions(), compression=NoCompression()))
    if ctx.zero_stage == 3:
        return Zero3Strategy(ctx)
    return Zero1Strategy(ctx) if ctx.zero_stage == 1 else Zero2Strategy(ctx)
