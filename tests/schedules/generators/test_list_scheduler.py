"""The greedy list scheduler: round trips, complete and verified lists, memory limits, its own timing."""

from __future__ import annotations

import math

import pytest

from duplexpipe.schedules.generators._common import linear_stages, v_rank, v_stages
from duplexpipe.schedules.generators.list_scheduler import Policy, Problem, Result, list_schedule, round_trips
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.verify import verify


def linear(ranks: int, mbs: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, comm: float = 0.0,
           limit: float | None = None) -> Problem:
    return Problem(ranks, mbs, tuple(range(ranks)), (f,) * ranks, (i,) * ranks, (w,) * ranks, (1.0,) * ranks,
                   (float(limit if limit is not None else ranks),) * ranks, comm)


def v_shape(ranks: int, mbs: int, comm: float = 0.0, limit: float | None = None) -> Problem:
    count = 2 * ranks
    return Problem(ranks, mbs, tuple(v_rank(ranks, s) for s in range(count)), (0.5,) * count, (0.5,) * count,
                   (0.5,) * count, (0.5,) * count, (float(limit if limit is not None else ranks),) * ranks, comm)


def as_schedule(problem: Problem, result: Result, v: bool = False) -> Schedule:
    table = v_stages(problem.num_ranks) if v else linear_stages(problem.num_ranks)
    rows = tuple(tuple(Action(s, Op(op), m) for op, s, m in row) for row in result.rows)
    return Schedule("greedy", problem.num_ranks, problem.num_microbatches, table, rows)


def weighted_peak(problem: Problem, row: tuple[tuple[str, int, int], ...]) -> float:
    live = peak = 0.0
    for op, stage, _ in row:
        live += problem.memory[stage] if op == "F" else -problem.memory[stage] if op == "W" else 0.0
        peak = max(peak, live)
    return peak


def test_round_trips_add_forwards_input_gradients_and_hops() -> None:
    # stage s: F(s..P-1) + I(s+1..P-1) + 2 hops per rank boundary crossed
    assert round_trips(linear(4, 8, f=1, i=2, comm=0.5)) == [4 + 6 + 3, 3 + 4 + 2, 2 + 2 + 1, 1]
    trips = round_trips(v_shape(2, 4, comm=1.0))  # ranks 0 1 1 0: the turn at rank 1 is local
    assert trips == [2 + 1.5 + 4, 1.5 + 1 + 2, 1 + 0.5 + 2, 0.5]


@pytest.mark.parametrize("policy", [Policy(), Policy(0.5, 0.0, False), Policy(3.0, 1.0, True, False)])
@pytest.mark.parametrize(("ranks", "mbs", "comm", "limit"), [(4, 8, 0.0, None), (4, 12, 0.5, 2.0), (3, 2, 1.0, 6.0),
                                                           (1, 3, 0.0, 1.0)])
def test_linear_results_are_complete_verified_within_the_limit_and_timed_exactly(
        policy: Policy, ranks: int, mbs: int, comm: float, limit: float | None) -> None:
    problem = linear(ranks, mbs, comm=comm, limit=limit)
    result = list_schedule(problem, policy)
    assert result is not None
    schedule = as_schedule(problem, result)
    verify(schedule)
    for row in result.rows:
        assert sorted(op for op, _, _ in row) == ["F"] * mbs + ["I"] * mbs + ["W"] * mbs
        assert weighted_peak(problem, row) <= problem.limit[0]
    # Messages wait for nothing but their transfer here, so the simulator agrees with the greedy's clock.
    assert simulate(schedule, CostModel(f=1, b=2, w=1, latency=comm)).makespan == pytest.approx(result.makespan)


@pytest.mark.parametrize("limit", [1.0, 2.0, 4.0, 8.0])
def test_v_shape_never_jams_down_to_its_smallest_limit(limit: float) -> None:
    problem = v_shape(4, 8, comm=0.25, limit=limit)
    for policy in (Policy(), Policy(1.5, 0.0, False, False)):
        result = list_schedule(problem, policy)
        assert result is not None
        verify(as_schedule(problem, result, v=True))
        assert all(weighted_peak(problem, row) <= limit for row in result.rows)


def test_one_activation_per_rank_runs_each_microbatch_round_trip_alone() -> None:
    ranks, mbs = 3, 4
    result = list_schedule(linear(ranks, mbs, limit=1.0), Policy())
    assert result is not None
    # Rank 0 starts microbatch k+1 only after W of k: P forwards, P-1 input-gradients, then its I and W.
    assert result.makespan == pytest.approx(mbs * (2 * ranks + 1))
    assert all(weighted_peak(linear(ranks, mbs), row) == 1.0 for row in result.rows)


def test_give_up_after_stops_runs_that_cannot_beat_it() -> None:
    problem = linear(4, 8)
    full = list_schedule(problem, Policy())
    assert full is not None
    assert list_schedule(problem, Policy(), give_up_after=full.makespan) == full
    assert list_schedule(problem, Policy(), give_up_after=full.makespan - 0.5) is None


def test_the_same_problem_and_policy_give_the_same_lists() -> None:
    problem = v_shape(4, 16, comm=0.5)
    first, second = list_schedule(problem, Policy(2.0)), list_schedule(problem, Policy(2.0))
    assert first is not None and first == second
    assert math.isfinite(first.makespan)
