"""Fit models to measurements: a CostModel to a measured Timeline, and which runs (and how many rounds) an
in-pipeline calibration of the runtime's work takes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import replace
from statistics import median

from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import Profile
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.simulate import CostModel
from duplexpipe.schedules.timeline import Timeline

MAX_SCALE = 4.0
"""The factors a calibration is trusted with (the in-pipeline compute scale, the wall-time scale): within a factor of
this of the model; beyond it the measurement was disturbed."""


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


def fit_wall_scale(profile: Profile, config: PlanConfig, runs: Sequence[tuple[str, int, float]]) -> float:
    """The geometric mean, over the calibration `runs` ((schedule, M, measured wall seconds per step) each),
    of the measured step over the planner's step for it under `config` (its cores and link; the profile's
    wall_scale taken as 1): what the model of the machine leaves out, as one factor on every prediction. It
    scales every candidate alike, so it changes predicted times, never their order. 1 without runs."""
    runs = [run for run in runs if run[2] > 0]
    if not runs:
        return 1.0
    if profile.overhead is not None:
        profile = replace(profile, overhead=replace(profile.overhead, wall_scale=1.0))
    base = replace(config, memory=2**62, zero_stages=(0,), compressions=("none",), chunks=(2,))
    logs = [math.log(wall / plan(profile, replace(base, schedules=(name,), microbatches=(m,))).best.step_s)
            for name, m, wall in runs]
    return math.exp(sum(logs) / len(logs))


LINKS = ("p2p_link", "tp_link")
"""The links a calibration measures, by their key in the profile's meta and PlanConfig's field: stage to stage
(round trips) and, under tensor parallelism, the TP group's (all-reduces)."""


def with_calibration(profile: Profile, config: PlanConfig, links: Collection[str] = LINKS
                     ) -> tuple[Profile, PlanConfig, str]:
    """The profile and planner settings with what a calibrated profile measured (schedule="auto", `duplexpipe
    profile --calibrate`): the `links` it measured (those the user did not give), then the calibration runs'
    measured over modelled wall time as the overhead's wall_scale (`fit_wall_scale` under this plan's cores and
    links at T = 1: the calibration trains the whole parts on every TP coordinate; not applied beyond
    [1/MAX_SCALE, MAX_SCALE], a disturbed measurement). Unchanged without them; the note says what was applied."""
    notes = []
    for key in (k for k in LINKS if k in links):
        measured = profile.meta.get(key)
        if isinstance(measured, list) and len(measured) == 2:
            latency, bandwidth = float(measured[0]), float(measured[1])
            link = Link(bandwidth=bandwidth, latency=latency)
            config = replace(config, tp_link=link) if key == "tp_link" else replace(config, p2p_link=link)
            notes.append(f"{'TP link' if key == 'tp_link' else 'link'} {latency * 1e6:.0f} us per message"
                         + (f", {bandwidth / 1e9:.3g} GB/s" if bandwidth < 1e15 else ""))
    walls = profile.meta.get("calibration_walls")
    if profile.overhead is not None and walls:
        factor = fit_wall_scale(profile, replace(config, tp=1), [(str(n), int(m), float(w)) for n, m, w in walls])
        if 1 / MAX_SCALE <= factor <= MAX_SCALE:
            profile = replace(profile, overhead=replace(profile.overhead, wall_scale=factor))
            notes.append(f"walls {factor:.3g}x the model of the machine (calibration runs)")
        else:
            notes.append(f"calibration walls {factor:.3g}x the model: not applied")
    return profile, config, "; ".join(notes)
