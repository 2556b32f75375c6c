"""Fit models to measurements: a CostModel to a measured Timeline, and which runs (and how many rounds) an
in-pipeline calibration of the runtime's work takes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from statistics import median

from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import Profile
from duplexpipe.schedules import registry
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


def calibration_runs(ranks: int, counts: Sequence[int]) -> list[tuple[str, int]]:
    """The (schedule, M) runs of an in-pipeline calibration on `ranks`, from the microbatch counts `counts`
    that divide the batch: GPipe at a small M (the smallest >= ranks, else the smallest) and at a larger one
    (the smallest >= twice that, else the largest), and ZB-H1 at the small one. Fused and split backward,
    actions, messages and rows per microbatch then all vary, so `solve_overhead(fit_scale=True)` can tell
    its terms apart (with one M only on 2 ranks it cannot: messages grow with the actions)."""
    if ranks < 1 or not counts or min(counts) < 1:
        raise ValueError(f"calibration runs need ranks >= 1 and microbatch counts >= 1, got {ranks}, {list(counts)}")
    ordered = sorted(set(counts))
    small = next((m for m in ordered if m >= ranks), ordered[0])
    large = next((m for m in ordered if m >= 2 * small), ordered[-1])
    runs = [("gpipe", small)] + ([("gpipe", large)] if large != small else []) + [("zb-h1", small)]
    return [(name, m) for name, m in runs if registry.check(name, ranks, m) is None]


def calibration_rounds(round_s: float, budget_s: float, least: int = 3, most: int = 20) -> int:
    """Measured rounds (one step of every calibration run each) that fit `budget_s` when one round takes
    `round_s`, at least `least` and at most `most`."""
    if not 1 <= least <= most or not budget_s >= 0 or not round_s >= 0:
        raise ValueError(f"calibration rounds need 1 <= least <= most, budget >= 0 and round time >= 0, got "
                         f"least={least}, most={most}, budget={budget_s!r}, round={round_s!r}")
    if round_s <= 0:
        return most
    return max(least, min(most, math.floor(budget_s / round_s)))



def fit_wall_scale(profile: Profile, config: PlanConfig, runs: Sequence[tuple[str, int, float]],
                   evaluations: int = 12, latency: bool = True) -> tuple[float, float]:
    """(wall scale, latency per message) at which the planner's steps of the calibration `runs` ((schedule,
    M, measured wall seconds per step) each) best match their measured walls, in least squares of the log
    ratios. The latency (never below `config.p2p_link.latency`, the measured round trip's) is what a blocked
    receive costs in wall time: a woken rank waiting for a core, more of them on the critical path in
    schedules that alternate more; the scale (given the latency, the geometric mean of measured over
    modelled) is what the rest of the model leaves out, as one factor on every prediction (it changes
    predicted times, never their order). Golden-section search over the latency up to a tenth of the fastest
    run, in `evaluations` plans of the runs (latency=False: the link's latency kept, only the scale fitted);
    the profile's own wall_scale is taken as 1. (1, the link's latency) without runs."""
    floor = config.p2p_link.latency
    runs = [run for run in runs if run[2] > 0]
    if not runs:
        return 1.0, floor
    if profile.overhead is not None:
        profile = replace(profile, overhead=replace(profile.overhead, wall_scale=1.0))
    base = replace(config, memory=2**62, zero_stages=(0,), compressions=("none",), chunks=(2,))

    def fit(latency: float) -> tuple[float, float]:
        link = Link(bandwidth=config.p2p_link.bandwidth, latency=latency)
        logs = [math.log(wall / plan(profile, replace(base, schedules=(name,), microbatches=(m,),
                                                      p2p_link=link)).best.step_s) for name, m, wall in runs]
        mean = sum(logs) / len(logs)
        return sum((x - mean) ** 2 for x in logs), math.exp(mean)

    if not latency:
        return fit(floor)[1], floor
    low, high = floor, floor + min(wall for _, _, wall in runs) / 10
    golden = (math.sqrt(5) - 1) / 2
    a, b = high - golden * (high - low), low + golden * (high - low)
    fa, fb = fit(a)[0], fit(b)[0]
    for _ in range(max(0, evaluations - 3)):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - golden * (high - low)
            fa = fit(a)[0]
        else:
            low, a, fa = a, b, fb
            b = low + golden * (high - low)
            fb = fit(b)[0]
    best = a if fa <= fb else b
    edge = fit(floor)
    if edge[0] <= min(fa, fb):  # no latency above the measured one explains the walls better
        return edge[1], floor
    return fit(best)[1], best
