"""Fit a CostModel to a measured Timeline, so a run can be compared with its simulation."""

from __future__ import annotations

from collections import defaultdict
from statistics import median

from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.simulate import CostModel
from duplexpipe.schedules.timeline import Timeline


def fit_cost_model(timeline: Timeline, latency: float = 0.0) -> CostModel:
    """Per-stage (f, b, w) from the medians of the measured F, B, I and W durations.

    b is the median full backward where the stage ran one, else median I + median W;
    w is the median W where the stage ran one, else half of b (it then matters only
    for I/W-split actions the run did not have). F&B pairs take the default cost f + b,
    which is what the default overlap hook runs: the forward, then the backward.
    """
    samples: dict[tuple[int, Op], list[float]] = defaultdict(list)
    for event in timeline.events:
        if event.action.op is not Op.OVERLAP_F_B:
            samples[(event.action.stage, event.action.op)].append(event.duration)
    stages = sorted({stage for stage, _ in samples})
    if not stages:
        raise ValueError("the timeline has no plain F, B, I or W events to fit a cost model to")
    table = {}
    for stage in stages:
        f = _median(samples, stage, Op.F)
        full, i, w = (_median(samples, stage, op) for op in (Op.B, Op.I, Op.W))
        b = full if full is not None else (i or 0.0) + (w or 0.0)
        weight = w if w is not None else b / 2
        table[stage] = (f or 0.0, b, min(weight, b))
    return CostModel(stage_costs=table, latency=latency)


def _median(samples: dict[tuple[int, Op], list[float]], stage: int, op: Op) -> float | None:
    values = samples.get((stage, op))
    return median(values) if values else None
