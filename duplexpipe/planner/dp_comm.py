"""Data parallelism in the planner's model: ZeRO stages, gradient compression, and the reduction's time.

What the trainer accepts (its ZeRO stages, its compression methods with their options, the pairs it refuses)
is `duplexpipe.dp_options`, read here; this module adds only the planner's data: what each ZeRO stage
moves and keeps, and each method's measured wire ratio, keyed by the trainer's options.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from duplexpipe.dp_options.compression import (
    AdaptiveOptions,
    Bf16Options,
    DGCOptions,
    Fp16Options,
    Int8Options,
    NoCompression,
    Options,
    PowerSGDOptions,
    compression_options,
    options_label,
)
from duplexpipe.dp_options.zero import ZERO_STAGES as TRAINER_ZERO_STAGES


@dataclass(frozen=True)
class ZeroStage:
    """How a ZeRO stage shards state over the D data-parallel replicas and what it moves per step."""

    stage: int
    """0 to 3 (`dp_options.ZERO_STAGES`, what DataParallelConfig.zero_stage accepts)."""
    description: str
    """One line for tables."""
    shard_optimizer: bool
    """Optimizer states are split over the D replicas (1/D each)."""
    shard_gradients: bool
    """Gradients are kept only as this replica's 1/D shard once reduced."""
    grad_traffic: float
    """Gradient bytes each replica puts on the wire per step, as a multiple of (D-1)/D x gradient bytes:
    2 for a ring all-reduce, 1 for a reduce-scatter."""
    param_traffic: float
    """Parameter bytes each replica puts on the wire per step after its last backward, as a multiple of (D-1)/D x
    parameter bytes (1: the all-gather of the updated shards; 0 under ZeRO-3, whose all-gathers are the schedule's
    UNSHARD actions)."""
    shard_params: bool = False
    """Parameters are kept as this replica's 1/D shard at rest and gathered whole per residency episode (ZeRO-3:
    the schedule's UNSHARD / RESHARD / REDUCE_GRAD actions, `schedules.shard`, priced by the simulator)."""


_TRAFFIC = {
    0: ZeroStage(0, "replicated: all-reduce the gradients, every replica steps everything", False, False, 2.0, 0.0),
    1: ZeroStage(1, "ZeRO-1: reduce-scatter gradients, step 1/D of the optimizer states, all-gather parameters",
                 True, False, 1.0, 1.0),
    2: ZeroStage(2, "ZeRO-2: as ZeRO-1, and keep only 1/D of the reduced gradients", True, True, 1.0, 1.0),
    3: ZeroStage(3, "ZeRO-3: as ZeRO-2, and keep only 1/D of the parameters at rest (gathered per episode)", True,
                 True, 1.0, 0.0, True),
}
ZERO_STAGES: Mapping[int, ZeroStage] = MappingProxyType({s: _TRAFFIC[s] for s in TRAINER_ZERO_STAGES
                                                          if s in _TRAFFIC})
"""The traffic model of every stage the trainer accepts. ZeRO-3's all-gathers and reduce-scatters depend on its
residency window: the planner lowers each candidate with `schedules.shard.add_unshard_reshard` and simulates them
(one all-gather per episode, one reduce-scatter per stage), so `reduction_time` is not used for it."""


@dataclass(frozen=True)
class Compression:
    """A gradient-compression method of the trainer (its options) and the planner's measured wire ratio."""

    options: Options
    """The trainer's options (`dp_options.compression`): what `DataParallelConfig.grad_compression` is set to."""
    wire_ratio: float
    """Gradient bytes on the wire are divided by this (1: none)."""
    note: str
    """Where the ratio comes from and what it costs in accuracy."""

    @property
    def name(self) -> str:
        """The trainer's method name with its non-default options: "powersgd", "powersgd(rank=1)"."""
        return options_label(self.options)


COMPRESSIONS: Mapping[str, Compression] = MappingProxyType({
    c.name: c for c in (
        Compression(NoCompression(), 1.0, "fp32 gradients"),
        Compression(Bf16Options(), 2.0, "a bfloat16 cast (torch hook); +0.06% loss"),
        Compression(Fp16Options(), 2.0, "a float16 cast (torch hook): half the bytes by construction; not in the "
                    "training benchmark"),
        Compression(Int8Options(), 3.9, "blocks of 256, stochastic rounding, error feedback; -0.29% loss"),
        Compression(PowerSGDOptions(), 9.9, "rank 4; 6.9x over 200 steps with its 10 exact ones; +2.93% loss"),
        Compression(PowerSGDOptions(rank=1), 11.8, "ratio and +13.7% loss from COMM-NOTES (not in the training "
                    "benchmark)"),
        Compression(DGCOptions(), 50.0, "99% sparsity, SGD momentum in the compressor; 20.1x over 200 steps with "
                    "its warm-up; +1.15% loss"),
    )
})
"""Lightest (least compression) first, keyed by `Compression.name`. The trainer's methods without a measured
ratio (top-k, random-k, threshold, other options) are not planned. Wire ratios are steady-state bytes per step,
measured in training on the GPT example at PP=2 x DP=2 (docs/benchmarks.md, "Gradient compression in training",
run of 2026-11-22 18:21 UTC), except powersgd(rank=1)'s (COMM-NOTES.md) and fp16's (exact); losses are the last
20 steps' mean against fp32."""


def zero_stage(stage: int) -> ZeroStage:
    """The table entry of ZeRO `stage`; ValueError lists the known stages."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"unknown ZeRO stage {stage!r}; known stages: {', '.join(map(str, ZERO_STAGES))}")
    return ZERO_STAGES[stage]


def compression(spec: str | Options) -> Compression:
    """The table entry of a method: its name ("powersgd", "powersgd(rank=1)") or the trainer's options object.
    Options without a measured ratio (the trainer's other methods and options) get ratio 1: the reduction is
    modelled uncompressed. ValueError for an unknown name, listing the known ones."""
    name = spec if isinstance(spec, str) else options_label(spec)
    if isinstance(spec, str) and name not in COMPRESSIONS:
        try:
            name = options_label(compression_options(spec))
        except ValueError:
            pass
    if name in COMPRESSIONS:
        return COMPRESSIONS[name]
    if isinstance(spec, str):
        raise ValueError(f"unknown compression {name!r}; known methods: {', '.join(COMPRESSIONS)} (the trainer's "
                         f"other methods have no measured wire ratio: pass their options object)")
    return Compression(spec, 1.0, UNMEASURED)


def adaptive_start(adaptive: AdaptiveOptions, planned: Options) -> AdaptiveOptions:
    """`adaptive` starting on the rung the planner chose (`planned`, one of its ladder's rungs): the planner's choice
    is the controller's starting point. ValueError when `planned` is not a rung."""
    for label, rung in zip(adaptive.rung_labels, adaptive.gradient_rungs(), strict=True):
        if rung == planned:
            return replace(adaptive, start=label)
    raise ValueError(f"the planner chose {options_label(planned)!r}, which is not a rung of the adaptive ladder "
                     f"{adaptive.ladder!r}")


UNMEASURED = "no measured wire ratio: the reduction is modelled uncompressed"
"""The note of a method the planner has no ratio for."""


@dataclass(frozen=True)
class Link:
    """A link between two data-parallel replicas (or two pipeline ranks)."""

    bandwidth: float = math.inf
    """Bytes per second each way (inf: transfers take only `latency`)."""
    latency: float = 0.0
    """Seconds per message."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or math.isnan(self.bandwidth):
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not 0 <= self.latency < math.inf:
            raise ValueError(f"link latency must be a finite number >= 0 s, got {self.latency!r}")

    def time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to move `nbytes` in `messages` messages."""
        return messages * self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


def reduction_time(grad_bytes: float, param_bytes: float, replicas: int, zero: ZeroStage,
                   method: Compression, link: Link) -> float:
    """Seconds one rank's data-parallel reduction (and ZeRO's all-gather) takes on `link`; 0 when D = 1.

    Ring collectives: per pass (an all-reduce is two) each replica sends (D-1)/D of the bytes in
    D-1 messages; compression divides the gradient bytes, never the parameter all-gather.
    """
    if replicas <= 1:
        return 0.0
    share = (replicas - 1) / replicas
    volume = share * (zero.grad_traffic * grad_bytes / method.wire_ratio + zero.param_traffic * param_bytes)
    passes = round(zero.grad_traffic + zero.param_traffic)
    return link.time(volume, passes * (replicas - 1))


def exposed_time(buckets: Sequence[tuple[float, float, float]], compute_end: float) -> float:
    """How far a rank's reductions run past `compute_end`, one after another on its link.

    `buckets`: per stage, (start, end, duration): its gradients become final layer by layer
    during its last backward pass, from `start` to `end` (as DDP-style buckets would), and
    reducing all of them takes `duration`. A reduction cannot start before its pass starts
    nor finish before the pass ends, so it hides behind that pass when it is no longer.
    """
    clock = 0.0
    for start, end, duration in sorted(buckets):
        clock = max(max(clock, start) + duration, end)
    return max(0.0, clock - compute_end)
