"""Tests of the lowering pass: where SENDs and RECVs go, for hand-made and generated schedules."""

from __future__ import annotations

import pytest

from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Op, Schedule, ScheduleError, StageInfo, parse_action
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.verify import verify


def make(rows: list[str], stages: list[int], microbatches: int, name: str = "hand") -> Schedule:
    """A schedule from one space-separated row of actions per rank; stages[s] is stage s's rank."""
    table = tuple(StageInfo(rank, s) for s, rank in enumerate(stages))
    acts = tuple(tuple(parse_action(t) for t in row.split()) for row in rows)
    return Schedule(name, len(rows), microbatches, table, acts)


def texts(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row) for row in schedule.actions]


def test_two_rank_1f1b_by_hand() -> None:
    s = make(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], [0, 1], 2)
    assert texts(lower(s)) == [
        # each gradient is received before the compute that precedes its consumer
        "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
        # the receive of 1F1's input is posted before 1B0, one compute ahead
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]


def test_sends_of_a_pair_follow_it_in_part_order() -> None:
    # V shape on 2 ranks: stages 0, 3 on rank 0 and 1, 2 on rank 1
    s = registry.build("dualpipev", 2, 4)
    low = lower(s)
    for rank, row in enumerate(low.actions):
        for pos, action in enumerate(row):
            if action.op is Op.OVERLAP_F_B:
                fwd, back = action.parts
                after = [a for a in row[pos + 1:pos + 3] if a.op in (Op.SEND_F, Op.SEND_B)]
                expected = []
                if low.next_stage(fwd.stage) is not None and low.stages[fwd.stage + 1].rank != rank:
                    expected.append(Action(fwd.stage, Op.SEND_F, fwd.microbatch))
                if low.prev_stage(back.stage) is not None and low.stages[back.stage - 1].rank != rank:
                    expected.append(Action(back.stage, Op.SEND_B, back.microbatch))
                assert after[:len(expected)] == expected


def test_no_comm_between_stages_on_one_rank() -> None:
    # DualPipeV: stages P-1 and P share rank P-1
    low = lower(registry.build("dualpipev", 4, 8))
    comms = [a for a in low.actions[3] if a.op.is_comm]
    assert comms
    assert not [a for a in comms if (a.stage, a.op) in {(3, Op.SEND_F), (4, Op.RECV_F), (4, Op.SEND_B),
                                                        (3, Op.RECV_B)}]
    single = make(["0F0 1F0 1B0 0B0"], [0, 0], 1)
    assert lower(single).actions == single.actions


def test_receive_order_follows_the_sender_not_the_consumer() -> None:
    # rank 1 consumes microbatch 1 before microbatch 0; rank 0 sends 0 first
    s = make(["0F0 0F1 0B1 0B0", "1F1 1B1 1F0 1B0"], [0, 1], 2)
    low = lower(s)
    row1 = texts(low)[1].split()
    assert row1.index("1RECV_F0") < row1.index("1RECV_F1") < row1.index("1F1")
    verify(low)


def test_lowering_is_idempotent_and_keeps_compute_order() -> None:
    s = registry.build("dualpipe", 4, 8)
    low = lower(s)
    assert lower(low) is low
    assert low.compute_only() == s
    assert low.has_comms and not s.has_comms


def _comm_facts(low: Schedule) -> None:
    """Assert the lowering rules on `low`, derived independently of lower.py."""
    where = {(r, a): p for r, p, a in low.iter_actions()}
    compute_index = {}
    for rank, row in enumerate(low.actions):
        computes = [a for a in row if a.op.is_compute]
        for k, a in enumerate(computes):
            for part in a.compute_parts():
                if part.op is not Op.W:
                    key = (part.stage, "F" if part.op is Op.F else "B", part.microbatch)
                    compute_index[key] = (rank, k, a)
    sent: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
    received: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
    for rank, row in enumerate(low.actions):
        last_compute = None
        for pos, a in enumerate(row):
            if a.op.is_compute:
                last_compute = a
                continue
            forward = a.op in (Op.SEND_F, Op.RECV_F)
            if a.op in (Op.SEND_F, Op.SEND_B):
                # right after the producing compute (only other sends in between)
                assert last_compute is not None and any(
                    p.stage == a.stage and p.microbatch == a.microbatch
                    and (p.op is Op.F) == forward for p in last_compute.compute_parts())
                peer = a.stage + 1 if forward else a.stage - 1
                key = (peer, "F" if forward else "B", a.microbatch)
                sent.setdefault((rank, low.stages[peer].rank), []).append(key)
            else:
                peer = a.stage - 1 if forward else a.stage + 1
                key = (a.stage, "F" if forward else "B", a.microbatch)
                received.setdefault((low.stages[peer].rank, rank), []).append(key)
                _, consumer_k, consumer = compute_index[key]
                assert where[(rank, consumer)] > pos
            assert low.stages[peer].rank != rank
    assert sent == received
    # each RECV sits right before compute k-1 of its consumer k, or earlier only as the order demands
    for (_, dst), keys in received.items():
        row = low.actions[dst]
        slot_of = []
        for key in keys:
            recv = Action(key[0], Op.RECV_F if key[1] == "F" else Op.RECV_B, key[2])
            pos = row.index(recv)
            slot_of.append(sum(1 for a in row[:pos] if a.op.is_compute))
        bound = None
        for k in range(len(keys) - 1, -1, -1):
            want = max(compute_index[keys[k]][1] - 1, 0)
            bound = want if bound is None else min(want, bound)
            assert slot_of[k] == bound
            bound = slot_of[k]


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 12), (6, 12)])
def test_lowering_rules_hold_for_every_generator(name: str, ranks: int, microbatches: int) -> None:
    if registry.check(name, ranks, microbatches) is not None:
        pytest.skip(registry.check(name, ranks, microbatches))
    s = registry.build(name, ranks, microbatches)
    low = lower(s)
    assert low.compute_only() == s
    _comm_facts(low)
    verify(low)


def test_lowering_a_broken_schedule_names_the_missing_consumer() -> None:
    s = make(["0F0 0B0", "1B0"], [0, 1], 1)  # 1F0 is missing
    with pytest.raises(ScheduleError, match=r"0F0 on rank 0 .* rank 1 has no 1F0"):
        lower(s)
    with pytest.raises(ScheduleError, match="7F0"):
        lower(make(["0F0 7F0"], [0], 1))
