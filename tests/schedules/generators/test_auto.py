"""The `auto` generator: registry interface, verified results within the limit, never worse than the
hand-made schedules of its placement, and one-line errors for bad arguments."""

from __future__ import annotations

from typing import Any

import pytest

from duplexpipe.schedules import registry
from duplexpipe.schedules.generators.auto import POLICIES, search
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.verify import verify

COSTS = {
    "uniform": CostModel(f=1, b=2, w=1, stage_scale=True),
    "latency": CostModel(f=1, b=2, w=1, latency=0.5, stage_scale=True),
    "w-light": CostModel(f=1, b=2.5, w=0.5, latency=0.25, stage_scale=True),
}


def cost_for(name: str, ranks: int) -> CostModel:
    """COSTS[name], or "heavy-last": uniform costs with the last of P stages 1.5x heavier."""
    if name == "heavy-last":
        return CostModel(f=1, b=2, w=1, stage_costs={ranks - 1: (1.5, 3.0, 1.5)}, stage_scale=True)
    return COSTS[name]


def weighted_peaks(schedule: Schedule, memory: float) -> list[float]:
    """Peak activations per rank with each stage-microbatch counting `memory`."""
    return [schedule_peak * memory for schedule_peak in (
        simulate(schedule).peak_activations(r) for r in range(schedule.num_ranks))]


def test_registry_builds_auto_with_its_options_and_names_it() -> None:
    assert registry.entry("auto").options == ("cost", "memory_limit", "placement", "stage_memory")
    s = registry.build("auto", 4, 8, cost=COSTS["latency"], memory_limit=6)
    assert s.name == "auto" and s.num_ranks == 4 and s.num_microbatches == 8 and s.num_stages == 4
    verify(s)
    assert max(simulate(s).peak_activations(r) for r in range(4)) <= 6
    default = registry.build("auto", 3, 5)  # CostModel() and memory_limit P
    verify(default)
    assert max(simulate(default).peak_activations(r) for r in range(3)) <= 3


@pytest.mark.parametrize("cost_name", [*sorted(COSTS), "heavy-last"])
@pytest.mark.parametrize(("ranks", "mbs"), [(2, 4), (4, 8), (4, 16)])
def test_linear_auto_is_never_worse_than_zb_h1_or_zb_h2_at_their_memory(cost_name: str, ranks: int,
                                                                         mbs: int) -> None:
    cost = cost_for(cost_name, ranks)
    for limit, rival in ((ranks, "zb-h1"), (2 * ranks, "zb-h2")):
        s = registry.build("auto", ranks, mbs, cost=cost, memory_limit=limit)
        verify(s)
        timeline = simulate(s, cost)
        assert max(timeline.peak_activations(r) for r in range(ranks)) <= limit
        assert timeline.makespan <= simulate(registry.build(rival, ranks, mbs), cost).makespan + 1e-9


@pytest.mark.parametrize("cost_name", ["uniform", "latency", "w-light"])
def test_v_auto_is_never_worse_than_zbv_and_counts_half_stages(cost_name: str) -> None:
    cost, ranks, mbs = COSTS[cost_name], 4, 8
    s = registry.build("auto", ranks, mbs, cost=cost, memory_limit=ranks, placement="v")
    verify(s)
    assert [info.rank for info in s.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert max(weighted_peaks(s, 0.5)) <= ranks  # 2P half-size stage-microbatches = P
    assert simulate(s, cost).makespan <= simulate(registry.build("zbv", ranks, mbs), cost).makespan + 1e-9


def test_the_greedy_beats_every_hand_made_schedule_with_twice_the_memory_and_latency() -> None:
    cost, ranks, mbs = COSTS["latency"], 4, 16
    result = search(ranks, mbs, cost=cost, memory_limit=2 * ranks, placement="v")
    assert result.winner.label.startswith("greedy")
    assert result.greedy_runs == len(POLICIES)
    assert result.winner in result.candidates
    best_hand_made = min(simulate(registry.build(n, ranks, mbs), cost).makespan for n in ("zb-h2", "zbv"))
    assert result.winner.makespan < best_hand_made
    assert simulate(result.schedule, cost).makespan == pytest.approx(result.winner.makespan)


def test_latency_half_at_p8_m32_reaches_the_bound_with_either_placement() -> None:
    # docs/benchmarks.md proves 117 (one stage per rank) and 116.5 (the V) are the shortest possible
    # makespans here, so issue 12's "3% below zb-h1" (113.49) is out of reach: auto reaches both bounds.
    cost = COSTS["latency"]
    linear = search(8, 32, cost=cost, memory_limit=8, placement="linear")
    v = search(8, 32, cost=cost, memory_limit=8, placement="v")
    assert (linear.bound, v.bound) == pytest.approx((117, 116.5))
    assert (linear.winner.makespan, v.winner.makespan) == pytest.approx((117, 116.5))
    assert v.greedy_runs == 0 and v.winner.label == "seed zbv"  # a seed at the bound: nothing to search
    for result in (linear, v):
        verify(result.schedule)
        timeline = simulate(result.schedule, cost)
        assert timeline.makespan == pytest.approx(result.winner.makespan)
        memory = 1.0 if result is linear else 0.5
        assert max(timeline.peak_activations(r) for r in range(8)) * memory <= 8
    again = search(8, 32, cost=cost, memory_limit=8, placement="v")
    assert again.schedule.actions == v.schedule.actions and again.candidates == v.candidates


def test_per_rank_limits_and_stage_memory_weigh_each_stage() -> None:
    ranks, mbs = 4, 12
    limits = [8.0, 6.0, 4.0, 2.0]
    memory = [1.0, 1.0, 2.0, 1.0]  # stage 2's activations are twice as large
    s = registry.build("auto", ranks, mbs, cost=COSTS["uniform"], memory_limit=limits, stage_memory=memory)
    verify(s)
    timeline = simulate(s)
    for rank in range(ranks):
        assert timeline.peak_activations(rank) * memory[rank] <= limits[rank]


def test_auto_returns_only_f_i_w_or_a_hand_made_order() -> None:
    s = registry.build("auto", 4, 8, cost=COSTS["latency"], memory_limit=8)
    ops = {a.op for row in s.actions for a in row}
    assert ops <= {Op.F, Op.I, Op.W, Op.B}


@pytest.mark.parametrize(("options", "needle"), [
    ({"cost": "F=1"}, "auto needs cost=CostModel"),
    ({"placement": "zigzag"}, "placement in ('linear', 'v'), got placement='zigzag'"),
    ({"memory_limit": 0}, "memory_limit made of finite numbers > 0, got 0"),
    ({"memory_limit": True}, "memory_limit made of finite numbers > 0, got True"),
    ({"memory_limit": float("nan")}, "memory_limit made of finite numbers > 0"),
    ({"memory_limit": [4, 4]}, "memory_limit as one number or 4 numbers, got 2"),
    ({"memory_limit": 0.5}, "memory_limit 0.5 on rank 0 is below the smallest feasible limit 1"),
    ({"memory_limit": 0.9, "placement": "v"}, "below the smallest feasible limit 1 "),
    ({"stage_memory": [-1, 1, 1, 1]}, "stage_memory made of finite numbers >= 0"),
])
def test_bad_options_name_the_value(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        registry.build("auto", 4, 8, **options)
    assert needle in str(registry.check("auto", 4, 8, **options))


def test_counts_and_unknown_options_are_checked_like_every_generator() -> None:
    assert "auto needs num_ranks >= 1, got num_ranks=0" in str(registry.check("auto", 0, 4))
    assert "does not take option(s) chunks" in str(registry.check("auto", 4, 8, chunks=2))
