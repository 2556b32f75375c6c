"""benchmarks.measured_vs_sim: the handoff gap of a simulated timeline is its message latency; the cost models."""

from __future__ import annotations

import pytest

from benchmarks.measured_vs_sim import QUICK, SimConfig, action_overheads, calibrated_cost, handoff_gaps
from duplexpipe import CostModel, Op, Timeline, build_schedule, simulate
from duplexpipe.schedules.timeline import Event


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipe"])
def test_a_handoff_gap_is_the_transfer_time_where_the_consumer_sat_idle(name: str) -> None:
    schedule = build_schedule(name, 4, 8)
    gaps = handoff_gaps(simulate(schedule, CostModel(f=1.0, b=2.0, w=1.0, latency=0.5)), schedule)
    assert gaps and all(g == pytest.approx(0.5) for g in gaps)
    assert all(g == pytest.approx(0.0) for g in handoff_gaps(simulate(schedule, CostModel(f=1.0, b=2.0, w=1.0)),
                                                             schedule))


def test_the_simulator_gets_the_sleeps_and_the_calibrated_costs() -> None:
    nominal = SimConfig(f_ms=10.0, i_ms=20.0, w_ms=30.0).cost()
    assert (nominal.f, nominal.b, nominal.w, nominal.fb) == pytest.approx((0.01, 0.05, 0.03, 0.06))
    cal = calibrated_cost({"f": 1.0, "b": 3.0, "i": 2.0, "w": 4.0})
    assert (cal.f, cal.b, cal.w, cal.fb) == (1.0, 3.0, 3.0, 4.0)  # W never above the fused B it is part of
    assert QUICK.spec().batch == QUICK.num_microbatches * QUICK.samples_per_microbatch and QUICK.world == 2


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "dualpipe"])
def test_action_overheads_are_what_ran_beyond_each_cost_and_the_gaps_between(name: str) -> None:
    """Each rank runs its compute actions back to back, each 0.1 beyond its cost, 0.05 apart: a first stage's I costs
    nothing and its B only W (its input takes no gradient), an F&B pair both parts."""
    schedule = build_schedule(name, 4, 8)
    costs = {"f": 1.0, "b": 3.0, "i": 2.0, "w": 1.0}
    events = []
    for rank in range(4):
        t = 0.0
        for action in schedule.actions[rank]:
            parts = action.compute_parts()
            if not parts:
                continue
            first = [schedule.prev_stage(p.stage) is None for p in parts]
            cost = sum(0.0 if p.op is Op.I and f else costs["w"] if p.op is Op.B and f else costs[p.op.name.lower()]
                       for p, f in zip(parts, first, strict=True))
            events.append(Event(rank, action, t, t + cost + 0.1))
            t += cost + 0.15
    inside, between = action_overheads(Timeline(name, 4, 8, tuple(events)), schedule, costs)
    assert (inside, between) == pytest.approx((0.1, 0.05))
