"""Fit models to measurements: a CostModel to a measured Timeline, and which runs (and how many rounds) an
in-pipeline calibration of the runtime's work takes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from statistics import median
from types import MappingProxyType
from typing import Any

from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import Profile
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.simulate import CostModel
from duplexpipe.schedules.timeline import Timeline

FIT_ERROR = "calibration_fit_error"
"""The profile meta key where `with_calibration` leaves `fit_error` of the model it fitted."""
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


CALIBRATION_OPTIONS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {"interleaved-1f1b": MappingProxyType({"chunks": 2})})
"""The generator options of a calibration run's schedule, by name (the planner's own default chunks, 2)."""


def calibration_schedule(name: str, ranks: int, m: int) -> Schedule:
    """The schedule of the calibration run (`name`, M) on `ranks` (with `CALIBRATION_OPTIONS`)."""
    return registry.build(name, ranks, m, **CALIBRATION_OPTIONS.get(name, {}))


def calibration_runs(ranks: int, counts: Sequence[int], parts: int = 0) -> list[tuple[str, int]]:
    """The (schedule, M) runs of an in-pipeline calibration on `ranks`, from the microbatch counts `counts`
    that divide the batch: GPipe at a small M (the smallest >= ranks, else the smallest) and at a larger one
    (the smallest >= twice that, else the largest), ZB-H1 at the small one, and, when the model has `parts` >=
    2 x ranks parts, interleaved 1F1B (2 chunks) at the small one. Fused and split backward, actions, messages and
    rows per microbatch then all vary, so `solve_overhead(fit_scale=True)` can tell its terms apart (with one M
    only on 2 ranks it cannot: messages grow with the actions). The interleaved run does the same compute as GPipe
    at that M with twice the actions and messages: without it a rank's actions and its compute grow together (GPipe
    at two M, ZB-H1's I + W a little dearer than B), and the solver may hand the per-action work to the compute
    scale (0 us per action) or the other way round, as the machine's noise falls."""
    if ranks < 1 or not counts or min(counts) < 1:
        raise ValueError(f"calibration runs need ranks >= 1 and microbatch counts >= 1, got {ranks}, {list(counts)}")
    ordered = sorted(set(counts))
    small = next((m for m in ordered if m >= ranks), ordered[0])
    large = next((m for m in ordered if m >= 2 * small), ordered[-1])
    runs = [("gpipe", small)] + ([("gpipe", large)] if large != small else []) + [("zb-h1", small)]
    if ranks > 1 and parts >= 2 * ranks:
        runs.append(("interleaved-1f1b", small))
    return [(name, m) for name, m in runs
            if registry.check(name, ranks, m, **CALIBRATION_OPTIONS.get(name, {})) is None]


def calibration_rounds(round_s: float, budget_s: float, least: int = 3, most: int = 20) -> int:
    """Measured rounds (one step of every calibration run each) that fit `budget_s` when one round takes
    `round_s`, at least `least` and at most `most`."""
    if not 1 <= least <= most or not budget_s >= 0 or not round_s >= 0:
        raise ValueError(f"calibration rounds need 1 <= least <= most, budget >= 0 and round time >= 0, got "
                         f"least={least}, most={most}, budget={budget_s!r}, round={round_s!r}")
    if round_s <= 0:
        return most
    return max(least, min(most, math.floor(budget_s / round_s)))


CORE_RANGE = 32.0
"""`fit_cores` searches the cores between the machine's and this many times fewer."""


def _logs(profile: Profile, config: PlanConfig, runs: Sequence[tuple[str, int, float]]) -> list[float]:
    """Per run (schedule, M, measured wall seconds per step): log(measured / the planner's step under `config`,
    with the profile's wall_scale taken as 1)."""
    if profile.overhead is not None:
        profile = replace(profile, overhead=replace(profile.overhead, wall_scale=1.0))
    base = replace(config, memory=2**62, zero_stages=(0,), compressions=("none",), chunks=(2,))
    return [math.log(wall / plan(profile, replace(base, schedules=(name,), microbatches=(m,))).best.step_s)
            for name, m, wall in runs]


def fit_wall_scale(profile: Profile, config: PlanConfig, runs: Sequence[tuple[str, int, float]]) -> float:
    """The geometric mean, over the calibration `runs` ((schedule, M, measured wall seconds per step) each),
    of the measured step over the planner's step for it under `config` (its cores and link; the profile's
    wall_scale taken as 1): what the model of the machine leaves out, as one factor on every prediction. It
    scales every candidate alike, so it changes predicted times, never their order. 1 without runs."""
    runs = [run for run in runs if run[2] > 0]
    return _geometric_mean(_logs(profile, config, runs)) if runs else 1.0


def _geometric_mean(logs: Sequence[float]) -> float:
    return math.exp(sum(logs) / len(logs))


def _worst_miss(logs: Sequence[float], scale: float) -> float:
    """The largest |measured / (scale x modelled) - 1| of runs whose log(measured / modelled) are `logs`."""
    return max(abs(math.exp(x) / scale - 1.0) for x in logs)


def fit_error(profile: Profile, config: PlanConfig, runs: Sequence[tuple[str, int, float]]) -> float:
    """The largest |measured / modelled - 1| over the calibration `runs` ((schedule, M, measured wall seconds per
    step) each) under `profile` (its wall scale applied) and `config`: how closely the fitted model reproduces the
    walls it was fitted to, so the gap below which it cannot tell two candidates' order. 0 without runs."""
    runs = [run for run in runs if run[2] > 0]
    if not runs:
        return 0.0
    return _worst_miss(_logs(profile, config, runs), profile.overhead.wall_scale if profile.overhead else 1.0)


def fit_cores(profile: Profile, config: PlanConfig, runs: Sequence[tuple[str, int, float]], most: float) -> float:
    """The cores C in [most / CORE_RANGE, most] under which the planner's steps of the calibration `runs`
    ((schedule, M, measured wall seconds per step) each, planned with `config` at C) best match the measured walls
    (least squares of the log ratios; a grid, then a golden-section search around its best point): the share of
    the `most` cores the calibration's ranks got while other processes ran. Unlike a wall scale it changes the
    order: on fewer cores every rank's CPU work (the runtime's per action and message included) adds to the step
    and a schedule's bubble costs less. `most` without runs."""
    runs = [run for run in runs if run[2] > 0]
    if not runs or not 0 < most < math.inf:
        return most

    def error(log_c: float) -> float:
        return sum(x * x for x in _logs(profile, replace(config, cores=math.exp(log_c)), runs))

    top = math.log(most)
    grid = [top - math.log(CORE_RANGE) * k / 10 for k in range(11)]
    errors = [error(x) for x in grid]
    best = min(range(len(grid)), key=errors.__getitem__)
    lo, hi = grid[min(best + 1, len(grid) - 1)], grid[max(best - 1, 0)]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = error(a), error(b)
    for _ in range(14):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = error(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = error(b)
    found = min(((fa, a), (fb, b), (errors[best], grid[best])))[1]
    return min(most, math.exp(found))


def calibration_machine(profile: Profile) -> tuple[int | None, int | None, float | None]:
    """(pipeline ranks, batch, cores shared by one replica's ranks) of the calibration that measured `profile`,
    from its meta ("calibration_mesh"; None where not recorded: older profiles, or cores on accelerators)."""
    mesh: Any = profile.meta.get("calibration_mesh")
    if not isinstance(mesh, dict):
        return None, None, None

    def number(key: str) -> Any:
        value = mesh.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
        return value if ok else None

    ranks, batch = number("ranks"), number("batch")
    return (int(ranks) if ranks else None, int(batch) if batch else None,
            float(number("cores")) if number("cores") else None)


LINKS = ("p2p_link", "tp_link", "host_link")
"""The links a calibration measures, by their key in the profile's meta and PlanConfig's field: stage to stage
(round trips), under tensor parallelism the TP group's (all-reduces), and on CUDA the copies between a device and
its pinned host memory (activation offload's)."""
LINK_NAMES = {"p2p_link": "link", "tp_link": "TP link", "host_link": "host link"}
"""How a note names each of `LINKS`."""


def _links(profile: Profile, config: PlanConfig, links: Collection[str]) -> tuple[PlanConfig, list[str]]:
    """`config` with the measured `links` of the profile's meta, and a note of each."""
    notes = []
    for key in (k for k in LINKS if k in links):
        measured = profile.meta.get(key)
        if isinstance(measured, list) and len(measured) == 2:
            latency, bandwidth = float(measured[0]), float(measured[1])
            link = Link(bandwidth=bandwidth, latency=latency)
            config = replace(config, tp_link=link) if key == "tp_link" else \
                replace(config, host_link=link) if key == "host_link" else replace(config, p2p_link=link)
            notes.append(f"{LINK_NAMES[key]} {latency * 1e6:.0f} us per message"
                         + (f", {bandwidth / 1e9:.3g} GB/s" if bandwidth < 1e15 else ""))
    return config, notes


def with_calibration(profile: Profile, config: PlanConfig, links: Collection[str] = LINKS
                     ) -> tuple[Profile, PlanConfig, str]:
    """The profile and planner settings with what a calibrated profile measured (schedule="auto", `duplexpipe
    profile --calibrate`): the `links` it measured (those the user did not give); the cores its ranks shared
    (`calibration_machine`) when `config` gives none or the same, and then the share of them the calibration runs
    got (`fit_cores` to their walls: the cores the plan uses); then the runs' measured over modelled wall time as
    the overhead's wall_scale (`fit_wall_scale` at those cores, on the calibration's ranks and batch at T = 1: the
    calibration trains the whole parts on every TP coordinate; not applied beyond [1/MAX_SCALE, MAX_SCALE], a
    disturbed measurement), and how closely the fitted model reproduces those runs (`fit_error`, in the profile's
    meta under FIT_ERROR: candidates closer than it are a tie). Unchanged without them; the note says what was
    applied."""
    config, notes = _links(profile, config, links)
    ranks, batch, cores = calibration_machine(profile)
    mine = cores is not None and config.cores in (None, cores)  # planning for the calibration's machine
    if mine:
        config = replace(config, cores=cores)
    walls = profile.meta.get("calibration_walls")
    if profile.overhead is None or not walls:
        if mine:
            notes.append(f"{cores:g} cores shared by the ranks, as calibrated")
        return profile, config, "; ".join(notes)
    runs = [(str(n), int(m), float(w)) for n, m, w in walls]
    calibrated = replace(config, ranks=ranks or config.ranks, batch=batch or config.batch, dp=1, tp=1)
    if mine and cores is not None:
        got = fit_cores(profile, calibrated, runs, cores)
        config, calibrated = replace(config, cores=got), replace(calibrated, cores=got)
        notes.append(f"{cores:g} cores shared by the ranks, as calibrated; their runs got {got:.3g} of them "
                     "(fitted to their walls)")
    logs = _logs(profile, calibrated, [run for run in runs if run[2] > 0])  # fit_wall_scale's and fit_error's
    factor = _geometric_mean(logs) if logs else 1.0
    if 1 / MAX_SCALE <= factor <= MAX_SCALE:
        profile = replace(profile, overhead=replace(profile.overhead, wall_scale=factor))
        if abs(factor - 1.0) >= 5e-3:
            notes.append(f"walls {factor:.3g}x the model of the machine (calibration runs)")
    else:
        notes.append(f"calibration walls {factor:.3g}x the model: not applied")
    error = _worst_miss(logs, profile.overhead.wall_scale if profile.overhead else 1.0) if logs else 0.0
    notes.append(f"the model is within {error:.0%} of its calibration runs: candidates closer than that are a tie")
    return replace(profile, meta={**profile.meta, FIT_ERROR: error}), config, "; ".join(notes)
