"""build_reducer: the reducer for a compression name or options object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from duplexpipe.comm.adaptive_reducer import AdaptiveReducer
from duplexpipe.comm.hooks import CastReducer, PowerSGDReducer
from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.reducers import Int8Reducer, SparseReducer
from duplexpipe.comm.reduction import ExactReducer, Reducer
from duplexpipe.dp_options.compression import (
    AdaptiveOptions,
    Bf16Options,
    DGCOptions,
    Fp16Options,
    Int8Options,
    Options,
    PowerSGDOptions,
    TopKOptions,
    compression_options,
)


def build_reducer(spec: str | Options | None, group: Any = None, meter: WireMeter | None = None,
                  buckets: Sequence[int] = ()) -> Reducer:
    """A reducer over `group` (None: the default group) for a method name, an options object or None (exact);
    "adaptive" chooses per bucket among `buckets` (their indices) from measured exposure.

    Raises ValueError naming the value for an unknown method or invalid options.
    """
    options = compression_options(spec)
    if isinstance(options, AdaptiveOptions):
        meter = meter if meter is not None else WireMeter()
        return AdaptiveReducer(options, buckets, build_reducer, group, meter)
    if isinstance(options, (Bf16Options, Fp16Options)):
        return CastReducer(options, group, meter)
    if isinstance(options, PowerSGDOptions):
        return PowerSGDReducer(options, group, meter)
    if isinstance(options, Int8Options):
        return Int8Reducer(options, group, meter)
    if isinstance(options, (TopKOptions, DGCOptions)):
        return SparseReducer(options, group, meter)
    return ExactReducer(group, meter)
