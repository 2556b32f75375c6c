"""Tests of fitting a CostModel to a timeline: a simulation's own costs are recovered."""

from __future__ import annotations

from dataclasses import replace

import pytest

from duplexpipe.planner.calibrate import (
    MAX_SCALE,
    calibration_rounds,
    calibration_runs,
    fit_cost_model,
    fit_wall_scale,
    with_calibration,
)
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead
from duplexpipe.schedules import registry
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.timeline import Timeline


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "dualpipe", "dualpipev"])
def test_fit_recovers_per_stage_costs(name: str) -> None:
    schedule = registry.build(name, 4, 8)
    truth = {s: (1.0 + 0.1 * s, 2.0 + 0.2 * s, 0.5 + 0.05 * s) for s in range(schedule.num_stages)}
    timeline = simulate(schedule, CostModel(stage_costs=truth))
    fitted = fit_cost_model(timeline)
    for stage, (f, b, w) in truth.items():
        got = fitted.stage_costs[stage]
        assert got[0] == pytest.approx(f) and got[1] == pytest.approx(b), (stage, got)
        if any(e.action.op.value == "W" and e.action.stage == stage for e in timeline.events):
            assert got[2] == pytest.approx(w), (stage, got)
    again = simulate(schedule, fitted)
    assert again.makespan == pytest.approx(timeline.makespan)
    assert again.bubble_ratio == pytest.approx(timeline.bubble_ratio)


def test_fit_rejects_an_empty_timeline() -> None:
    with pytest.raises(ValueError, match="no plain"):
        fit_cost_model(Timeline("x", 1, 1, ()))


def test_calibration_runs_vary_m_and_backward_kind() -> None:
    assert calibration_runs(4, [4, 8, 16, 32]) == [("gpipe", 4), ("gpipe", 8), ("zb-h1", 4)]
    assert calibration_runs(2, [1, 2, 4, 8, 16]) == [("gpipe", 2), ("gpipe", 4), ("zb-h1", 2)]
    assert calibration_runs(4, [2, 3]) == [("gpipe", 2), ("gpipe", 3), ("zb-h1", 2)], "below P: the smallest"
    assert calibration_runs(4, [8]) == [("gpipe", 8), ("zb-h1", 8)], "one M: no second GPipe"
    with pytest.raises(ValueError, match="microbatch counts >= 1"):
        calibration_runs(4, [])


def test_calibration_rounds_fit_the_budget_within_bounds() -> None:
    assert calibration_rounds(0.5, 3.0) == 6
    assert calibration_rounds(0.01, 3.0) == 20, "capped at most"
    assert calibration_rounds(10.0, 3.0) == 3, "never fewer than least"
    assert calibration_rounds(0.0, 3.0, least=2, most=7) == 7
    with pytest.raises(ValueError, match="1 <= least <= most"):
        calibration_rounds(1.0, 3.0, least=5, most=4)



def test_fit_wall_scale_is_the_measured_over_modelled_wall_of_the_calibration_runs() -> None:
    part = PartProfile(1e-3, 1e-3, 1e-3, 0, 0, 1024, 1024)
    profile = Profile((part,) * 4, 4, overhead=RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.2, wall_scale=3.0))
    config = PlanConfig(ranks=4, batch=32, memory=2**40, cores=2)
    unscaled = replace(profile, overhead=RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.2))
    model = {(n, m): plan(unscaled, replace(config, schedules=(n,), microbatches=(m,))).best.step_s
             for n, m in (("gpipe", 4), ("gpipe", 8), ("zb-h1", 4))}
    walls = [(n, m, 1.7 * step) for (n, m), step in model.items()]
    assert fit_wall_scale(profile, config, walls) == pytest.approx(1.7), "the profile's own scale is ignored"
    mixed = [(n, m, step * k) for ((n, m), step), k in zip(model.items(), (1.0, 2.0, 4.0), strict=True)]
    assert fit_wall_scale(profile, config, mixed) == pytest.approx(2.0), "geometric mean"
    assert fit_wall_scale(profile, config, []) == 1.0
    scaled = replace(profile, overhead=RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.2, wall_scale=1.7))
    again = plan(scaled, replace(config, schedules=("gpipe",), microbatches=(4,))).best
    assert again.step_s == pytest.approx(1.7 * model[("gpipe", 4)]), "the planner multiplies its times by it"


def test_with_calibration_applies_the_measured_link_and_walls_once_in_range() -> None:
    """What schedule="auto" and `duplexpipe plan` take from a calibrated profile."""
    part = PartProfile(1e-3, 1e-3, 1e-3, 0, 0, 1024, 1024)
    overhead = RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.0)
    config = PlanConfig(ranks=4, batch=32, memory=2**40)
    bare = Profile((part,) * 4, 4, overhead=overhead)
    model = plan(bare, replace(config, schedules=("gpipe",), microbatches=(4,))).best.step_s
    measured = replace(bare, meta={"p2p_link": [2e-5, 1e9], "calibration_walls": [["gpipe", 4, 2 * model]]})
    profile, planned, note = with_calibration(measured, config)
    assert (planned.p2p_link.latency, planned.p2p_link.bandwidth) == (2e-5, 1e9) and "link 20 us per message" in note
    assert profile.overhead is not None and profile.overhead.wall_scale > 1.0 and "walls" in note
    kept, same, _ = with_calibration(measured, config, links=())
    assert same.p2p_link == config.p2p_link
    far = replace(bare, meta={"calibration_walls": [["gpipe", 4, 2 * MAX_SCALE * model]]})
    unchanged, _, note = with_calibration(far, config)
    assert unchanged == far and "not applied" in note
    assert with_calibration(Profile((part,) * 4, 4), config) == (Profile((part,) * 4, 4), config, "")
