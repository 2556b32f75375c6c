"""Lower bounds on the makespan: the two-sided figures of docs/benchmarks.md, the V's terms, and never above a
real schedule (hand-made or searched) that fits the same limit."""

from __future__ import annotations

import pytest

from duplexpipe.schedules import registry
from duplexpipe.schedules.generators.auto import search, search_problem
from duplexpipe.schedules.generators.bounds import earliest_starts, makespan_bound, rank_bound
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.simulate import CostModel, simulate

LATENCY = CostModel(f=1, b=2, w=1, latency=0.5, stage_scale=True)
COSTS = {
    "uniform": CostModel(f=1, b=2, w=1, stage_scale=True),
    "latency": LATENCY,
    "w-light": CostModel(f=1, b=2.5, w=0.5, latency=0.25, stage_scale=True),
}


def _bound(ranks: int, mbs: int, cost: CostModel, limit: float, placement: str) -> float:
    return makespan_bound(search_problem(ranks, mbs, cost=cost, memory_limit=limit, placement=placement))


def test_one_stage_per_rank_gives_the_two_sided_bound() -> None:
    # RT = 8 F + 7 I + 14 x 0.5 = 22 after rank 0's first F: head 22 - 8, tail 22 - 1 - 7 x 2 = 7, work 96.
    assert _bound(8, 32, LATENCY, 8, "linear") == pytest.approx(117)
    assert _bound(16, 64, LATENCY, 16, "linear") == pytest.approx(237)
    assert _bound(8, 32, LATENCY, 16, "linear") == pytest.approx(106.5)  # enough memory: LB


def test_the_v_bound_comes_from_the_turn_rank() -> None:
    # Rank 7 holds stages 7 and 8 (F = I = W = 0.5 each, 16 half-size activations in limit 8). Its first
    # F starts at 7 x (0.5 + 0.5); its first I (stage 8's, microbatch 0) after stages 8..15 forward and
    # 15..9 backward: 7 + 0.5 + 7 x 1 + 0.5 + 7 x 1 = 22. Until then it runs at most 16 forwards (8): idle 14.
    # After its last forward (a stage 8 F at t) it has at most 0.5 + 16 x (0.5 + 0.5) of work, and that
    # microbatch needs 23 more to end stage 0's W: 96 - 16.5 + 14 + 23 = 116.5, zbv's makespan.
    problem = search_problem(8, 32, cost=LATENCY, memory_limit=8, placement="v")
    ef, ei = earliest_starts(problem)
    turn = rank_bound(problem, 7, ef, ei)
    assert (turn.start, turn.first_i, turn.head_idle, turn.after, turn.chain) == pytest.approx((7, 22, 14, 16.5, 23))
    assert turn.value == pytest.approx(116.5)
    assert makespan_bound(problem) == pytest.approx(116.5)
    assert simulate(registry.build("zbv", 8, 32), LATENCY).makespan == pytest.approx(116.5)
    assert _bound(16, 64, LATENCY, 16, "v") == pytest.approx(236.5)


def test_all_activations_fitting_drops_the_head_term() -> None:
    problem = search_problem(4, 4, cost=COSTS["uniform"], memory_limit=4, placement="linear")
    ef, ei = earliest_starts(problem)
    first = rank_bound(problem, 0, ef, ei)
    assert first.head_idle == 0.0  # 4 microbatches fit in limit 4: the last F may precede every gradient
    assert makespan_bound(problem) <= simulate(registry.build("gpipe", 4, 4)).makespan


def _peak_fits(schedule: Schedule, cost: CostModel, memory: float, limit: float) -> bool:
    timeline = simulate(schedule, cost)
    return max(timeline.peak_activations(r) for r in range(schedule.num_ranks)) * memory <= limit + 1e-9


@pytest.mark.parametrize("cost_name", [*sorted(COSTS), "heavy-last"])
@pytest.mark.parametrize(("ranks", "mbs"), [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_no_fitting_schedule_is_shorter_than_the_bound(cost_name: str, ranks: int, mbs: int) -> None:
    cost = COSTS.get(cost_name) or CostModel(f=1, b=2, w=1, stage_costs={ranks - 1: (1.5, 3.0, 1.5)},
                                              stage_scale=True)
    if cost_name == "heavy-last":  # the last share of the model: stage P-1 here, stages 2P-2 and 2P-1 in the V
        v_cost = CostModel(f=1, b=2, w=1, stage_costs={2 * ranks - 2: (1.5, 3.0, 1.5), 2 * ranks - 1: (1.5, 3.0, 1.5)},
                           stage_scale=True)
    else:
        v_cost = cost
    checked = 0
    for limit in (ranks, 1.5 * ranks, 2 * ranks):
        for placement, names, c, memory in (("linear", ("gpipe", "1f1b", "zb-h1", "zb-h2"), cost, 1.0),
                                            ("v", ("zbv", "dualpipev"), v_cost, 0.5)):
            bound = _bound(ranks, mbs, c, limit, placement)
            auto = search(ranks, mbs, cost=c, memory_limit=limit, placement=placement)
            assert auto.bound == pytest.approx(bound)
            assert bound <= auto.winner.makespan + 1e-9
            for name in names:
                if registry.check(name, ranks, mbs) is None:
                    schedule = registry.build(name, ranks, mbs)
                    if _peak_fits(schedule, c, memory, limit):
                        assert bound <= simulate(schedule, c).makespan + 1e-9, (name, limit)
                        checked += 1
    assert checked >= 4
