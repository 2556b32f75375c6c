"""Tests of fitting a CostModel to a timeline: a simulation's own costs are recovered."""

from __future__ import annotations

import pytest

from duplexpipe.planner.calibrate import fit_cost_model
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
