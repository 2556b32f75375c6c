"""benchmarks.measured_vs_sim: the handoff gap of a simulated timeline is its message latency; the cost models."""

from __future__ import annotations

import pytest

from benchmarks.measured_vs_sim import QUICK, SimConfig, calibrated_cost, handoff_gaps
from duplexpipe import CostModel, build_schedule, simulate


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
