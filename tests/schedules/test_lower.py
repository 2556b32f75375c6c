"""Tests of the lowering pass: where SENDs and RECVs go, for hand-made and generated schedules."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Op, Schedule, StageInfo, parse_action
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
        # rank 1 sends B0 (t=4) after rank 0 sent F1 (t=2): the receive comes after that send
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1",
        # the receive of 1F1's input is posted before 1B0, one compute ahead
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]


def test_gpipe_sends_before_it_receives_what_is_produced_later() -> None:
    # the old lowering posted 0RECV_B0 before 0SEND_F2 while rank 1 received F2 before sending B0:
    # NCCL, one stream per pair, would hang; F2 is produced (t=3) before B0 (t=6)
    low = lower(registry.build("gpipe", 2, 3))
    assert texts(low) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0RECV_B1 0B0 0RECV_B2 0B1 0B2",
        "1RECV_F0 1RECV_F1 1F0 1RECV_F2 1F1 1F2 1B0 1SEND_B0 1B1 1SEND_B1 1B2 1SEND_B2",
    ]
    verify(low, nccl=True)


def test_messages_produced_at_once_go_lower_rank_first() -> None:
    # two model copies (DualPipe-like): 0F0 and 2F1 both end at t=1, 3B1 and 1B0 both at t=4 (+ a message)
    table = (StageInfo(0, 0), StageInfo(1, 1), StageInfo(1, 0), StageInfo(0, 1))
    rows = ("0F0 3F1 3B1 0B0", "2F1 1F0 1B0 2B1")
    s = Schedule("two-copies", 2, 2, table, tuple(tuple(parse_action(t) for t in r.split()) for r in rows))
    assert texts(lower(s)) == [
        "0F0 0SEND_F0 3RECV_F1 3F1 3B1 3SEND_B1 0RECV_B0 0B0",
        # rank 1 receives F0 before it sends F1, and B1 before it sends B0: rank 0's order
        "1RECV_F0 2F1 2SEND_F1 1F0 2RECV_B1 1B0 1SEND_B0 2B1",
    ]
    verify(lower(s), nccl=True)


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


def _message(low: Schedule, a: Action) -> tuple[int, tuple[str, int, int]]:
    """The peer rank of comm action `a`, and its message: (F or B, receiving stage, microbatch)."""
    forward, sending = a.op in (Op.SEND_F, Op.RECV_F), a.op in (Op.SEND_F, Op.SEND_B)
    peer = a.stage + 1 if forward == sending else a.stage - 1
    receiver = peer if sending else a.stage
    return low.stages[peer].rank, ("F" if forward else "B", receiver, a.microbatch)


def _comm_facts(low: Schedule) -> None:
    """Assert the lowering rules on `low`, derived independently of lower.py and verify.py."""
    compute_index = {}
    computes_at: list[list[int]] = []  # per rank: the list positions of its computes
    for rank, row in enumerate(low.actions):
        computes_at.append([p for p, a in enumerate(row) if a.op.is_compute])
        for k, p in enumerate(computes_at[rank]):
            for part in row[p].compute_parts():
                if part.op is not Op.W:
                    compute_index[("F" if part.op is Op.F else "B", part.stage, part.microbatch)] = k
    with_peer: dict[tuple[int, int], list[tuple[int, bool, tuple[str, int, int]]]] = {}
    for rank, row in enumerate(low.actions):
        last_compute = None
        for pos, a in enumerate(row):
            if a.op.is_compute:
                last_compute = a
                continue
            peer, message = _message(low, a)
            assert peer != rank
            sending = a.op in (Op.SEND_F, Op.SEND_B)
            if sending:  # right after the producing compute (only other sends in between)
                assert last_compute is not None and any(
                    p.stage == a.stage and p.microbatch == a.microbatch
                    and (p.op is Op.F) == (message[0] == "F") for p in last_compute.compute_parts())
            with_peer.setdefault((rank, peer), []).append((pos, sending, message))
    for (rank, peer), ops in with_peer.items():
        # NCCL: both ranks post the messages between them in one order (so also sends == receives)
        assert [m for _, _, m in ops] == [m for _, _, m in with_peer[(peer, rank)]]
        for i, (pos, sending, message) in enumerate(ops):
            if sending:
                continue
            cpos = computes_at[rank]
            slot, consumer = sum(1 for p in cpos if p < pos), compute_index[message]
            assert slot <= consumer  # received before the consumer
            # one compute ahead of the consumer, unless the pair order stops it: then the pair's
            # neighbouring op sits in the way (a SEND of that compute, or a RECV at the same spot)
            want = max(consumer - 1, 0)
            if slot < want:
                assert i + 1 < len(ops) and ops[i + 1][0] < cpos[slot + 1]
            elif slot > want:
                assert i > 0 and ops[i - 1][0] > cpos[slot - 1]


def _hangs_on_nccl(low: Schedule) -> bool:
    """Run `low` as NCCL does; True when it gets stuck.

    Each rank runs its list; posting a SEND or RECV never blocks but appends it to the one
    stream the rank has with that peer; the heads of two ranks' streams with each other run
    together when they are the same message (a SEND meeting its RECV), else both wait; a
    compute waits until each input from another rank has been received.
    """
    streams: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}
    done: set[tuple[str, int, int]] = set()
    position = [0] * low.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(low.actions):
            while position[rank] < len(row):
                a = row[position[rank]]
                if a.op.is_comm:
                    peer, message = _message(low, a)
                    streams.setdefault((rank, peer), deque()).append(message)
                elif any(m not in done for m in _remote_inputs(low, a)):
                    break
                position[rank] += 1
                progress = True
        for (rank, peer), mine in streams.items():
            theirs = streams.get((peer, rank))
            while mine and theirs and mine[0] == theirs[0]:
                done.add(mine.popleft())
                theirs.popleft()
                progress = True
    return position != [len(row) for row in low.actions] or any(streams.values())


def _remote_inputs(low: Schedule, a: Action) -> list[tuple[str, int, int]]:
    """The messages compute `a` consumes: inputs whose producing stage is on another rank."""
    found = []
    for part in a.compute_parts():
        peer = low.prev_stage(part.stage) if part.op is Op.F else \
            low.next_stage(part.stage) if part.op in (Op.B, Op.I) else None
        if peer is not None and low.stages[peer].rank != low.stages[part.stage].rank:
            found.append(("F" if part.op is Op.F else "B", part.stage, part.microbatch))
    return found


def test_the_nccl_model_hangs_where_directions_cross() -> None:
    crossed = make(["0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
                    "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"], [0, 1], 2)
    verify(crossed)  # fine under the contract (per ordered pair), as on gloo
    assert _hangs_on_nccl(crossed)  # rank 0 waits in RECV_B0 for SEND_B0, behind RECV_F1 on rank 1
    assert not _hangs_on_nccl(lower(crossed.compute_only()))


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 12), (6, 12)])
def test_lowering_rules_hold_for_every_generator(name: str, ranks: int, microbatches: int) -> None:
    if registry.check(name, ranks, microbatches) is not None:
        pytest.skip(registry.check(name, ranks, microbatches))
    s = registry.build(name, ranks, microbatches)
    low = lower(s)
    assert low.compute_only() == s
    _comm_facts(low)
    verify(low, nccl=True)
    assert not _hangs_on_nccl(low)


def test_lowering_a_broken_schedule_names_the_missing_consumer() -> None:
    s = make(["0F0 0B0", "1B0"], [0, 1], 1)  # 1F0 is missing
    with pytest.raises(ScheduleError, match=r"0F0 on rank 0 .* rank 1 has no 1F0"):
        lower(s)
    with pytest.raises(ScheduleError, match="7F0"):
        lower(make(["0F0 7F0"], [0], 1))


MICROBATCHES = (*range(1, 9), 12, 16, 24, 31, 32)
"""Every M up to 8 (where warm-up and cool-down overlap), then larger ones, odd and even, up to 32."""


def _valid_args(upto_ranks: int = 8) -> list[tuple[str, int, int, dict[str, int]]]:
    cases: list[tuple[str, int, int, dict[str, int]]] = []
    for name in registry.names():
        options = [{}, {"chunks": 3}] if name == "interleaved-1f1b" else [{}]
        for extra in options:
            cases += [(name, p, m, extra) for p in range(2, upto_ranks + 1) for m in MICROBATCHES
                      if registry.check(name, p, m, **extra) is None]
    return cases


def test_every_generator_lowers_to_an_nccl_safe_order() -> None:
    """Every generator, P in 2..8, every valid M of MICROBATCHES: the lowering verifies, NCCL pair order
    included, and runs under NCCL's rules."""
    cases = _valid_args()
    assert {c[0] for c in cases} == set(registry.names()) and len(cases) > 500
    for name, ranks, microbatches, extra in cases:
        s = registry.build(name, ranks, microbatches, **extra)
        low = lower(s)
        assert low.compute_only() == s
        verify(low, nccl=True)
        assert not _hangs_on_nccl(low)


@st.composite
def valid_schedules(draw: st.DrawFn) -> Schedule:
    """A deadlock-free schedule in any shape: 1 to 3 stages per rank on 2 to 4 ranks, each backward a B
    or an I and a later W, each rank's order read off one random global execution order."""
    ranks, per_rank, mbs = draw(st.integers(2, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    count = ranks * per_rank
    placement = draw(st.sampled_from(["blocks", "round-robin", "zig-zag"]))
    rank_of = [s // per_rank if placement == "blocks" else s % ranks if placement == "round-robin"
               else (s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks) for s in range(count)]
    split = draw(st.lists(st.booleans(), min_size=count * mbs, max_size=count * mbs))
    done: set[tuple[str, int, int]] = set()
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    while len(done) < count * mbs * 2 + sum(split):
        ready = []
        for s in range(count):
            for m in range(mbs):
                if ("F", s, m) not in done and (s == 0 or ("F", s - 1, m) in done):
                    ready.append(("F", s, m))
                elif ("B", s, m) not in done and ("F", s, m) in done and (s == count - 1 or ("B", s + 1, m) in done):
                    ready.append(("B", s, m))
                elif split[s * mbs + m] and ("B", s, m) in done and ("W", s, m) not in done:
                    ready.append(("W", s, m))
        kind, s, m = draw(st.sampled_from(ready))
        op = Op.F if kind == "F" else Op.W if kind == "W" else Op.I if split[s * mbs + m] else Op.B
        rows[rank_of[s]].append(Action(s, op, m))
        done.add((kind, s, m))
    table = tuple(StageInfo(rank_of[s], s) for s in range(count))
    return Schedule("random", ranks, mbs, table, tuple(tuple(r) for r in rows))


@settings(max_examples=150, deadline=None)
@given(valid_schedules())
def test_any_deadlock_free_schedule_lowers_to_an_nccl_safe_order(schedule: Schedule) -> None:
    verify(schedule)  # by construction
    low = lower(schedule)
    _comm_facts(low)
    verify(low, nccl=True)
    assert not _hangs_on_nccl(low)
