"""Tests of the compiled program and its execution: instruction costs, hand-timed runs, where a run stops."""

from __future__ import annotations

import pytest

from duplexpipe.schedules import registry
from duplexpipe.schedules.execute import run_program
from duplexpipe.schedules.ir import Op, Schedule, StageInfo, parse_action
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.program import COMPUTE, RECV, SEND, Durations, analyze
from duplexpipe.schedules.verify import verify


def make(rows: list[str], stages: list[tuple[int, int]], microbatches: int) -> Schedule:
    """A schedule from one space-separated row of actions per rank; stages[s] is stage s's (rank, group)."""
    table = tuple(StageInfo(rank, group) for rank, group in stages)
    acts = tuple(tuple(parse_action(t) for t in row.split()) for row in rows)
    return Schedule("hand", len(rows), microbatches, table, acts)


# a lowered 1F1B on two ranks, one stage each, two microbatches
LOWERED = make(["0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
                "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"], [(0, 0), (1, 1)], 2)
# two stages of one chain on one rank (local handoffs), with an F&I pair
LOCAL = make(["0F0 1F0 0F1 (1F1;1I0)OVERLAP_F_B 1W0 1B1 0B0 0B1"], [(0, 0), (0, 1)], 2)


def costs(schedule: Schedule, durations: Durations) -> dict[str, float]:
    """The duration of each compute instruction, by action text."""
    program = analyze(schedule, Layout.of(schedule), durations)
    return {str(ins[1]): ins[4] for row in program for ins in row if ins[0] == COMPUTE}


def test_instructions_mirror_the_actions_and_name_their_tokens() -> None:
    layout = Layout.of(LOWERED)
    program = analyze(LOWERED, layout)
    kinds = {Op.SEND_F: SEND, Op.SEND_B: SEND, Op.RECV_F: RECV, Op.RECV_B: RECV}
    for row, actions in zip(program, LOWERED.actions, strict=True):
        assert [ins[0] for ins in row] == [kinds.get(a.op, COMPUTE) for a in actions]
    half = layout.num_stages * layout.num_microbatches  # tokens: forward inputs, then output gradients
    f_in_1_0, grad_out_0_0 = 1 * 2 + 0, half + 0 * 2 + 0
    assert program[0][1] == (SEND, f_in_1_0)  # 0SEND_F0 makes stage 1's input for microbatch 0
    assert program[1][0] == (RECV, f_in_1_0)
    f0_on_rank1, b0_on_rank0 = program[1][1], program[0][6]
    assert f0_on_rank1[2] == (-1 - f_in_1_0,)  # a message: needs 0SEND_F0 and 1RECV_F0
    assert b0_on_rank0[2] == (-1 - grad_out_0_0,) and b0_on_rank0[3] == ()  # first stage: nothing to pass on
    assert all(ins[4] == 0.0 for row in program for ins in row if ins[0] == COMPUTE)  # Durations.zero


def test_local_handoffs_are_inputs_and_outputs_of_the_computes() -> None:
    layout = Layout.of(LOCAL)
    row = analyze(LOCAL, layout)[0]
    f_in_1_0 = 1 * 2 + 0
    assert row[0][3] == (f_in_1_0,) and row[1][2] == (f_in_1_0,)  # 0F0 hands to 1F0 on the same rank
    assert row[0][2] == () and row[1][3] == ()  # first stage has no input, last forward no output


def test_compute_costs_come_from_the_durations() -> None:
    verify(LOCAL)
    table = Durations(f=[1.0, 10.0], b=[2.0, 20.0], i=[1.5, 15.0], w=[0.5, 5.0])
    got = costs(LOCAL, table)
    assert got["0F0"] == 1.0 and got["1F0"] == 10.0 and got["1B1"] == 20.0 and got["0B0"] == 2.0
    assert got["1W0"] == 5.0
    assert got["(1F1;1I0)OVERLAP_F_B"] == 10.0 + 15.0  # no fb: the sum of the parts
    with_fb = Durations(table.f, table.b, table.i, table.w, fb=[30.0, 40.0])
    # fb of the forward part's stage, minus w for an I part
    assert costs(LOCAL, with_fb)["(1F1;1I0)OVERLAP_F_B"] == 40.0 - 5.0


def test_full_backward_pairs_cost_fb() -> None:
    schedule = registry.build("dualpipe", 2, 4)
    count, zeros = schedule.num_stages, [0.0] * schedule.num_stages
    plain = Durations([1.0] * count, [2.0] * count, zeros, zeros)
    fused = Durations(plain.f, plain.b, zeros, zeros, fb=[2.5] * count)
    pairs = [str(a) for _, _, a in schedule.iter_actions()
             if a.op is Op.OVERLAP_F_B and a.parts[1].op is Op.B]
    assert pairs
    without, with_fb = costs(schedule, plain), costs(schedule, fused)
    assert all(without[p] == 3.0 and with_fb[p] == 2.5 for p in pairs)
    assert all(without[str(a)] == with_fb[str(a)] for _, _, a in schedule.iter_actions() if a.op is Op.F)


@pytest.mark.parametrize("record", [True, False])
def test_run_times_a_lowered_schedule_by_hand(record: bool) -> None:
    layout = Layout.of(LOWERED)
    program = analyze(LOWERED, layout, Durations(f=[1.0, 1.0], b=[2.0, 2.0], i=[2.0, 2.0], w=[0.0, 0.0]))
    run = run_program(program, layout.num_tokens, comm=0.5, record=record)
    assert run.finished and run.position == [8, 8] and run.blocked_on == [None, None]
    if not record:
        assert run.events == [[], []]
        return
    # rank 1's 1F0 waits for 0SEND_F0 (t=1) + 0.5; 1F1 for its rank; 0B0 for 1SEND_B0 (4.5) + 0.5
    expected = [[("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 5.0, 7.0), ("0B1", 8.0, 10.0)],
                [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1F1", 4.5, 5.5), ("1B1", 5.5, 7.5)]]
    assert [[(str(a), s, e) for a, s, e in row] for row in run.events] == expected


def test_a_stuck_run_stops_where_each_rank_waits() -> None:
    # rank 0 waits for 1B0's gradient before sending 0F0's output; rank 1 waits for that output
    stuck = make(["0F0 0RECV_B0 0B0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1",
                  "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"], [(0, 0), (1, 1)], 2)
    layout = Layout.of(stuck)
    run = run_program(analyze(stuck, layout), layout.num_tokens)
    half = layout.num_stages * layout.num_microbatches
    assert not run.finished
    assert run.position == [2, 1]  # at 0B0 and at 1F0
    assert run.blocked_on == [half + 0, 1 * 2 + 0]  # the data of 0B0's and 1F0's messages (no SEND yet)


def test_all_posted_runs_messages_without_receives() -> None:
    # the lowered 1F1B without its RECVs: stuck at the first consumer, unless every RECV counts as posted
    layout = Layout.of(LOWERED)
    program = analyze(LOWERED, layout, Durations(f=[1.0, 1.0], b=[2.0, 2.0], i=[2.0, 2.0], w=[0.0, 0.0]))
    no_recvs = [[ins for ins in row if ins[0] != RECV] for row in program]
    stuck = run_program(no_recvs, layout.num_tokens, comm=0.5)
    assert not stuck.finished and stuck.position == [4, 0]  # at 0B0 and at 1F0
    run = run_program(no_recvs, layout.num_tokens, comm=0.5, record=True, all_posted=True)
    assert run.finished
    # the same times as with the RECVs posted (each one was posted before its message was sent)
    assert run.events == run_program(program, layout.num_tokens, comm=0.5, record=True).events


def test_memory_grows_linearly_with_the_ranks() -> None:
    """`analyze` keeps message queues only for pairs of ranks that talk, not a table of every pair (P^2)."""
    import tracemalloc

    from duplexpipe.schedules.lower import lower

    def peak(ranks: int) -> int:
        lowered = lower(registry.build("1f1b", ranks, 2))
        layout = Layout.of(lowered)
        tracemalloc.start()
        try:
            analyze(lowered, layout)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(250), peak(1000)
    assert large < 8 * small, f"4x the ranks took {large / small:.1f}x the memory"  # was 15.6x with P^2 tables
