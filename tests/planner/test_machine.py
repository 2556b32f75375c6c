"""contention: processor sharing on C cores against hand-computed timelines, and the plain simulator when C >= P."""

from __future__ import annotations

from dataclasses import replace

import pytest

from duplexpipe.errors import ScheduleError
from duplexpipe.planner.machine import Machine, simulate_shared
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import parse_action, schedule_from_rows
from duplexpipe.schedules.simulate import CostModel, simulate


def spans(run) -> list[tuple[int, str, float, float]]:  # type: ignore[no-untyped-def]
    return sorted((e.rank, str(e.action), e.start, e.end) for e in run.events)


def test_two_ranks_on_one_core_share_it_and_never_leave_it_idle() -> None:
    # GPipe, P=2, M=2, F=1, B=2. Alone: 0F0; then 0F1 and 1F0 at rate 1/2 (both end at 3); 1F1 and 1B0
    # alone; then 0B0 and 1B1 at rate 1/2 (end at 10); 0B1 alone. The core is never idle: 12 = all work.
    run = simulate_shared(registry.build("gpipe", 2, 2), CostModel(f=1, b=2, w=1), Machine(cores=1))
    assert spans(run.timeline) == [(0, "0B0", 6.0, 10.0), (0, "0B1", 10.0, 12.0), (0, "0F0", 0.0, 1.0),
                                   (0, "0F1", 1.0, 3.0), (1, "1B0", 4.0, 6.0), (1, "1B1", 6.0, 10.0),
                                   (1, "1F0", 1.0, 3.0), (1, "1F1", 3.0, 4.0)]
    assert run.step == 12.0
    # two cores: each rank has one, as in the plain simulator
    assert simulate_shared(registry.build("gpipe", 2, 2), CostModel(f=1, b=2, w=1), Machine(cores=2)).step == 9.0


def test_overheads_per_action_per_message_and_per_step() -> None:
    # 1F1B, P=2, M=1, F=1, B=2, latency 0.5; action 0.25, SEND/RECV 0.125 each, step 1 (a device per rank).
    # rank 0: F0 [0, 1.25], SEND_F0 to 1.375, RECV_B0 to 1.5; rank 1: RECV_F0 [0, 0.125], F0 at
    # 1.375 + 0.5 = 1.875 to 3.125, B0 to 5.375, SEND_B0 to 5.5, step work to 6.5; rank 0: B0 at 6.0 to
    # 8.25, step work to 9.25.
    cost = CostModel(f=1, b=2, w=1, latency=0.5)
    run = simulate_shared(registry.build("1f1b", 2, 1), cost, Machine(action_s=0.25, message_s=0.125, step_s=1))
    assert spans(run.timeline) == [(0, "0B0", 6.0, 8.25), (0, "0F0", 0.0, 1.25), (1, "1B0", 3.125, 5.375),
                                   (1, "1F0", 1.875, 3.125)]
    assert run.rank_end == (9.25, 6.5) and run.step == 9.25


def test_the_compute_scale_multiplies_compute_before_the_action_overhead() -> None:
    # as above with every compute action 1.5x its cost-model time: rank 0 F0 [0, 1.75], messages to 2.0;
    # rank 1 F0 at 1.875 + 0.5 = 2.375 to 4.125, B0 (3 + 0.25) to 7.375, SEND_B0 to 7.5, step to 8.5;
    # rank 0 B0 at 8.0 to 11.25, step work to 12.25.
    cost = CostModel(f=1, b=2, w=1, latency=0.5)
    machine = Machine(action_s=0.25, message_s=0.125, step_s=1, compute_scale=1.5)
    run = simulate_shared(registry.build("1f1b", 2, 1), cost, machine)
    assert spans(run.timeline) == [(0, "0B0", 8.0, 11.25), (0, "0F0", 0.0, 1.75), (1, "1B0", 4.125, 7.375),
                                   (1, "1F0", 2.375, 4.125)]
    assert run.rank_end == (12.25, 8.5)


def test_the_wall_scale_stretches_every_time_of_the_run() -> None:
    cost = CostModel(f=1, b=2, w=1, latency=0.5)
    machine = Machine(action_s=0.25, message_s=0.125, step_s=1, compute_scale=1.5)
    plain = simulate_shared(registry.build("1f1b", 2, 1), cost, machine)
    stretched = simulate_shared(registry.build("1f1b", 2, 1), cost, replace(machine, wall_scale=2.0))
    assert spans(stretched.timeline) == [(r, a, 2 * s, 2 * e) for r, a, s, e in spans(plain.timeline)]
    assert stretched.rank_end == (24.5, 17.0) and stretched.step == 2 * plain.step


def test_waiting_for_a_message_takes_no_core() -> None:
    # 1F1B, P=2, M=1 on one core with latency 10: while a message is in flight no rank computes, and the
    # waiting rank does not slow the one that computes
    run = simulate_shared(registry.build("1f1b", 2, 1), CostModel(f=1, b=2, w=1, latency=10), Machine(cores=1))
    assert run.step == simulate(registry.build("1f1b", 2, 1), CostModel(f=1, b=2, w=1, latency=10)).makespan == 26


@pytest.mark.parametrize("name", registry.names())
def test_enough_cores_and_no_overhead_equal_the_plain_simulator_exactly(name: str) -> None:
    cost = CostModel(f=1.0, b=2.5, w=1.1, latency=0.3, stage_costs={0: (1.3, 2.0, 0.7)})
    for ranks, m in ((2, 4), (4, 8)):
        schedule = registry.build(name, ranks, m)
        plain = simulate(schedule, cost)
        for cores in (None, ranks, ranks + 3):
            run = simulate_shared(schedule, cost, Machine(cores=cores))
            assert spans(run.timeline) == spans(plain) and run.step == plain.makespan


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
def test_one_core_runs_all_work_back_to_back_when_there_is_no_latency(name: str) -> None:
    schedule = registry.build(name, 4, 8)
    cost = CostModel(f=1.0, b=2.0, w=0.5)
    work = sum(e.duration for e in simulate(schedule, cost).events)
    assert simulate_shared(schedule, cost, Machine(cores=1)).step == pytest.approx(work)
    assert simulate_shared(schedule, cost, Machine(cores=0.5)).step == pytest.approx(2 * work)  # a share of one
    two = simulate_shared(schedule, cost, Machine(cores=2)).step
    assert work / 2 <= two + 1e-9 and two < work  # two cores: at least half the work, less than all of it


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"cores": 0}, "cores must be a number > 0 or None"),
    ({"cores": -2}, "cores must be a number > 0 or None"),
    ({"cores": float("inf")}, "cores must be a number > 0 or None"),
    ({"cores": True}, "cores must be a number > 0 or None"),
    ({"action_s": -1.0}, "action_s must be a finite number >= 0"),
    ({"message_s": float("inf")}, "message_s must be a finite number >= 0"),
    ({"step_s": float("nan")}, "step_s must be a finite number >= 0"),
    ({"compute_scale": 0.0}, "compute_scale must be a finite number > 0"),
    ({"wall_scale": -1.0}, "wall_scale must be a finite number > 0"),
])
def test_bad_machines(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Machine(**kwargs)  # type: ignore[arg-type]


def test_a_deadlocked_schedule_is_explained() -> None:
    # rank 1 waits for 0F1 first, which rank 0 runs only after 0B0, which needs 1B0
    rows = [[parse_action(a) for a in ("0F0", "0B0", "0F1", "0B1")],
            [parse_action(a) for a in ("1F1", "1F0", "1B0", "1B1")]]
    schedule = schedule_from_rows(rows, "stuck")
    with pytest.raises(ScheduleError, match="simulation stuck"):
        simulate_shared(schedule, CostModel(), Machine(cores=1))


def test_a_fused_backward_costs_what_was_measured_and_i_w_keep_theirs() -> None:
    # 1F1B, P=2, M=1, F=1, B = I + W = 2 + 1 by the cost model, a fused B measured at 2.5
    cost = CostModel(f=1, b=3, w=1)
    run = simulate_shared(registry.build("1f1b", 2, 1), cost, Machine(), full_backward=[2.5, 2.5])
    assert run.step == 1 + 1 + 2.5 + 2.5
    zb = registry.build("zb-h1", 2, 2)  # I and W actions: unchanged by full_backward
    assert simulate_shared(zb, cost, Machine(), [0.0, 0.0]).step == simulate(zb, cost).makespan
    with pytest.raises(ValueError, match=r"full_backward needs one cost per stage \(2\), got 1"):
        simulate_shared(zb, cost, Machine(), [1.0])
    with pytest.raises(ValueError, match="full_backward costs must be finite numbers >= 0"):
        simulate_shared(zb, cost, Machine(), [1.0, -1.0])
