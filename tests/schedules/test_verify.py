"""Tests of the verifier: sound schedules pass, each kind of defect is caught and named."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Op, Schedule, StageInfo, parse_action, schedule_from_rows
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.simulate import simulate
from duplexpipe.schedules.verify import (
    check_nccl_order,
    check_structure,
    find_deadlock,
    happens_before_graph,
    verify,
)


def make(rows: list[str], stages: list[int], microbatches: int) -> Schedule:
    """A schedule from one space-separated row of actions per rank; stages[s] is stage s's rank."""
    table = tuple(StageInfo(rank, s) for s, rank in enumerate(stages))
    acts = tuple(tuple(parse_action(t) for t in row.split()) for row in rows)
    return Schedule("hand", len(rows), microbatches, table, acts)


# a correct lowered 1F1B on two ranks, the base of the negative tests
RANK0 = "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1"
RANK1 = "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"


def errors_of(rows: list[str], stages: list[int] | None = None, microbatches: int = 2) -> str:
    with pytest.raises(ScheduleError) as err:
        verify(make(rows, stages or [0, 1], microbatches))
    return str(err.value)


def test_the_base_case_is_sound() -> None:
    verify(make([RANK0, RANK1], [0, 1], 2))
    assert find_deadlock(make([RANK0, RANK1], [0, 1], 2)) is None


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("ranks,microbatches", [(1, 3), (2, 4), (4, 8), (4, 16), (8, 16)])
def test_every_generator_verifies(name: str, ranks: int, microbatches: int) -> None:
    if registry.check(name, ranks, microbatches) is not None:
        pytest.skip(registry.check(name, ranks, microbatches))
    s = registry.build(name, ranks, microbatches)
    verify(s)
    verify(lower(s))


# the same, with both ranks posting their messages to each other in one order (what NCCL needs)
NCCL0 = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1"


def test_nccl_pair_order_is_checked_only_when_asked() -> None:
    crossed = make([RANK0, RANK1], [0, 1], 2)  # rank 0 receives B0 before sending F1, rank 1 the reverse
    verify(crossed)  # sound under the contract (and on gloo)
    with pytest.raises(ScheduleError) as err:
        verify(crossed, nccl=True)
    assert ("ranks 0 and 1 disagree on the order of their messages: rank 0's 2nd op with rank 1 is "
            "0RECV_B0 (list position 2), rank 1's is 1RECV_F1 (list position 2)") in str(err.value)
    with pytest.raises(ScheduleError, match="rank 0's 2nd op with rank 1 is 0RECV_B0"):
        check_nccl_order(crossed)
    fixed = make([NCCL0, RANK1], [0, 1], 2)
    verify(fixed, nccl=True)
    check_nccl_order(fixed)


def test_nccl_order_names_the_first_difference_on_any_pair() -> None:
    # three ranks: 0-1 agree, 1-2 cross at their 3rd op
    rows = ["0F0 0SEND_F0 0RECV_B0 0B0",
            "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0",
            "2RECV_F0 2F0 2B0 2SEND_B0"]
    verify(make(rows, [0, 1, 2], 1), nccl=True)
    rows[1] = "1RECV_F0 1RECV_B0 1F0 1SEND_F0 1B0 1SEND_B0"  # posts the gradient receive before sending F0
    with pytest.raises(ScheduleError) as err:
        verify(make(rows, [0, 1, 2], 1), nccl=True)
    msg = str(err.value)
    assert "ranks 1 and 2 disagree" in msg and "rank 1's 1st op with rank 2 is 1RECV_B0 (list position 1)" in msg
    assert "rank 2's is 2RECV_F0 (list position 0)" in msg


def test_nccl_order_reports_a_missing_message_and_a_bad_action() -> None:
    short = make([RANK0, "1RECV_F0 1F0 1B0 1SEND_B0"], [0, 1], 2)  # structurally broken: no 1F1 ...
    with pytest.raises(ScheduleError) as err:
        check_nccl_order(short)
    assert ("rank 0's 3rd op with rank 1 is 0SEND_F1 (list position 4), rank 1's is missing (rank 1 has only 2 "
            "ops with rank 0)") in str(err.value)
    with pytest.raises(ScheduleError, match="0SEND_B0 at rank 0, position 1 is not a message between two ranks"):
        check_nccl_order(make(["0F0 0SEND_B0 0B0"], [0], 1))


@pytest.mark.parametrize("name", registry.names())
def test_compute_only_schedules_verify_for_nccl(name: str) -> None:
    ranks, microbatches = (4, 8) if registry.check(name, 4, 8) is None else (2, 4)
    verify(registry.build(name, ranks, microbatches), nccl=True)  # checks the lowering's pair order


def test_swapped_receive_and_consumer() -> None:
    msg = errors_of([RANK0, RANK1.replace("1RECV_F0 1F0", "1F0 1RECV_F0")])
    assert "1F0 at rank 1, position 0" in msg and "1RECV_F0" in msg and "posted later" in msg


def test_missing_receive() -> None:
    msg = errors_of([RANK0, RANK1.replace("1RECV_F1 ", "")])
    assert "1F1" in msg and "1RECV_F1" in msg and "never posts" in msg


def test_missing_send() -> None:
    msg = errors_of([RANK0.replace(" 0SEND_F1", ""), RANK1])
    assert "1RECV_F1 on rank 1 has no matching 0SEND_F1 on rank 0" in msg


def test_receive_order_differs_from_send_order() -> None:
    rank1 = "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"
    msg = errors_of([RANK0, rank1])
    assert "out of order" in msg and "0SEND_F0" in msg and "1RECV_F1" in msg


def test_swapped_sends() -> None:
    rank0 = "0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0RECV_B1 0B0 0B1"
    msg = errors_of([rank0, RANK1])
    assert "out of order" in msg and "0SEND_F1" in msg and "1RECV_F0" in msg


def test_backward_before_forward() -> None:
    msg = errors_of(["0B0 0F0 0F1 0B1"], [0], 2)
    assert "0B0 at rank 0, position 0" in msg and "before its forward 0F0" in msg
    msg = errors_of(["(0F0;0B0)OVERLAP_F_B 0F1 0B1"], [0], 2)
    assert "0B0" in msg and "before its forward" in msg


def test_deadlock_cycle_names_each_blocked_action() -> None:
    rows = ["0F0 0RECV_B0 0B0 0SEND_F0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    msg = errors_of(rows, microbatches=1)
    assert "rank 0 blocked at 0B0 waiting for 1SEND_B0 on rank 1" in msg
    assert "rank 1 blocked at 1F0 waiting for 0SEND_F0 on rank 0" in msg
    assert "cycle: rank 0: 0B0 -> 0SEND_F0 => rank 1: 1F0 -> 1B0 -> 1SEND_B0 => rank 0: 0B0" in msg
    assert "[0B0]" in msg and "[1F0]" in msg  # the rank x step picture
    found = find_deadlock(make(rows, [0, 1], 1))
    assert found is not None
    assert [(r, str(a), w, p) for r, a, w, p in found.blocked] == [(0, "0B0", "1SEND_B0", 1),
                                                                   (1, "1F0", "0SEND_F0", 0)]
    assert [r for r, _ in found.cycle] == [0, 1]


def test_compute_only_deadlock_is_found_before_lowering() -> None:
    msg = errors_of(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"])
    assert "after lowering" not in msg
    assert "rank 0 blocked at 0B0 waiting for 1B0" in msg
    assert "rank 1 blocked at 1F1 waiting for 0F1 on rank 0" in msg


def test_local_handoff_in_the_wrong_order_deadlocks() -> None:
    msg = errors_of(["1F0 0F0 1B0 0B0"], [0, 0], 1)
    assert "rank 0 blocked at 1F0 waiting for 0F0 on rank 0" in msg


def test_three_rank_cycle_is_reported_rank_by_rank() -> None:
    rows = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1SEND_F0 1RECV_B1 1RECV_B0 1B0 1SEND_B0 1RECV_F1 1F1 1SEND_F1 1B1 1SEND_B1",
            "2RECV_F0 2RECV_F1 2F1 2B1 2SEND_B1 2F0 2B0 2SEND_B0"]  # rank 2 runs microbatch 1 first
    found = find_deadlock(make(rows, [0, 1, 2], 2))
    assert found is not None
    assert [r for r, _ in found.cycle] == [1, 2]
    assert "rank 1 blocked at 1B0 waiting for 2SEND_B0 on rank 2" in found.message
    assert "rank 2 blocked at 2F1 waiting for 1SEND_F1 on rank 1" in found.message
    assert "rank 0 blocked at 0B0 waiting for 1SEND_B0 on rank 1" in found.message
    assert ("cycle: rank 1: 1B0 -> 1SEND_B0 -> 1RECV_F1 -> 1F1 -> 1SEND_F1 => "
            "rank 2: 2F1 -> 2B1 -> 2SEND_B1 -> 2F0 -> 2B0 -> 2SEND_B0 => rank 1: 1B0") in found.message


@pytest.mark.parametrize("rows,stages,mbs,needles", [
    (["0F0 0B0 1F0", "1B0"], [0, 1], 1, ["1F0 at rank 0", "stage 1 runs on rank 1"]),
    (["0F0 0B0 5F0"], [0], 1, ["5F0", "unknown stage 5"]),
    (["0F0 0B0 0F3"], [0], 2, ["0F3", "microbatch 3 is outside 0..1"]),
    (["0F0 0F0 0B0"], [0], 1, ["0F0 at rank 0, position 1", "duplicate forward"]),
    (["0F0 0F1 0B0"], [0], 2, ["incomplete", "0B1 (or 0I1 and 0W1) on rank 0"]),
    (["0F0 0I0"], [0], 1, ["incomplete", "0W0 on rank 0"]),
    (["0F0 0W0 0I0"], [0], 1, ["0W0", "before its input gradient 0I0"]),
    (["0F0 0B0 0W0"], [0], 1, ["0W0", "after a full backward"]),
    (["0F0 0I0 0B0"], [0], 1, ["0B0", "duplicate backward"]),
])
def test_completeness_and_placement_errors(rows: list[str], stages: list[int], mbs: int,
                                           needles: list[str]) -> None:
    msg = errors_of(rows, stages, mbs)
    for needle in needles:
        assert needle in msg


def test_dualpipe_microbatches_belong_to_one_copy() -> None:
    s = registry.build("dualpipe", 2, 4)
    # stage 0 (the downward copy) only sees microbatches 0..1
    bad = tuple(tuple(Action(a.stage, a.op, 2) if str(a) == "0F0" else a for a in row) for row in s.actions)
    with pytest.raises(ScheduleError, match=r"0F2 .* microbatch 2 is outside 0..1"):
        verify(Schedule(s.name, s.num_ranks, s.num_microbatches, s.stages, bad))


@pytest.mark.parametrize("rows,stages,needles", [
    (["0F0 0SEND_F0 0B0"], [0, 0], ["0SEND_F0", "stages 0 and 1 both run on rank 0"]),
    (["0SEND_F0 0F0 0RECV_B0 0B0", RANK1.replace(" 1F1 1B1 1SEND_B1", "").replace(" 1RECV_F1", "")],
     [0, 1], ["0SEND_F0 at rank 0, position 0", "sent before its producer 0F0"]),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0 1SEND_F0"], [0, 1],
     ["1SEND_F0", "stage 1 is the last stage"]),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1RECV_F0 1F0 1B0 1SEND_B0"], [0, 1],
     ["1RECV_F0 at rank 1, position 1", "duplicate"]),
])
def test_comm_errors(rows: list[str], stages: list[int], needles: list[str]) -> None:
    msg = errors_of(rows, stages, 1)
    for needle in needles:
        assert needle in msg


def test_torch_deferred_receives_break_the_pair_order() -> None:
    """torch's defer_pp_recv lowering of DualPipeV posts a gradient receive where its sender's next
    message is an activation; under order-only matching (NCCL) the two would be swapped."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    def schedule(defer: bool) -> Schedule:
        ops = get_schedule_ops("DualPipeV", 4, 8, with_comms=True, defer_pp_recv=defer)
        rows = tuple(tuple(parse_action(str(a)) for a in row if a is not None and "SHARD" not in str(a)
                           and "REDUCE" not in str(a)) for row in ops)
        stages = tuple(StageInfo(s if s < 4 else 7 - s, s) for s in range(8))
        return Schedule("torch-dualpipev", 4, 8, stages, rows)

    verify(schedule(False), nccl=True)  # torch's NCCL-proven order passes the pair-order check too
    with pytest.raises(ScheduleError, match="out of order"):
        verify(schedule(True))


@st.composite
def interleavings(draw: st.DrawFn) -> Schedule:
    """A 1F1B-shaped pipeline where each rank orders its F and B freely (F m before B m)."""
    ranks, mbs = draw(st.integers(2, 4)), draw(st.integers(1, 4))
    rows = []
    for r in range(ranks):
        todo = {m: [Action(r, Op.F, m), Action(r, Op.B, m)] for m in range(mbs)}
        row = []
        while todo:
            m = draw(st.sampled_from(sorted(todo)))
            row.append(todo[m].pop(0))
            if not todo[m]:
                del todo[m]
        rows.append(tuple(row))
    return Schedule("random", ranks, mbs, tuple(StageInfo(r, r) for r in range(ranks)), tuple(rows))


@settings(max_examples=60, deadline=None)
@given(interleavings())
def test_deadlock_search_agrees_with_networkx(schedule: Schedule) -> None:
    for s in (schedule, lower(schedule)):
        check_structure(s)
        acyclic = nx.is_directed_acyclic_graph(happens_before_graph(s))
        found = find_deadlock(s)
        assert (found is None) == acyclic
        if found is not None:
            assert found.cycle and all(r in {b[0] for b in found.blocked} for r, _ in found.cycle)
            with pytest.raises(ScheduleError, match="blocked at"):
                simulate(s)


def test_large_dualpipe_is_checked_in_linear_time() -> None:
    start = time.perf_counter()
    verify(lower(registry.build("dualpipe", 32, 256)))
    assert time.perf_counter() - start < 5.0  # about 0.1 s; a quadratic pass would take minutes


def naive_ok(s: Schedule) -> bool:
    """A slow, direct reading of verify's checks (1) and (3), to cross-check the fast one."""
    found: dict[tuple[Op, int, int], list[tuple[int, int]]] = {}
    for r, p, a in s.iter_actions():
        for part in a.compute_parts():
            if part.stage >= s.num_stages or s.stages[part.stage].rank != r \
                    or part.microbatch not in s.microbatches_of_stage(part.stage):
                return False
            found.setdefault((part.op, part.stage, part.microbatch), []).append((r, p))
    if any(len(v) > 1 for v in found.values()):
        return False
    at = {k: v[0][1] for k, v in found.items()}
    for stage in range(s.num_stages):
        for m in s.microbatches_of_stage(stage):
            f, b, i, w = (at.get((op, stage, m)) for op in (Op.F, Op.B, Op.I, Op.W))
            back = b if b is not None else i
            if f is None or (b is None) == (i is None) or not f < back:  # type: ignore[operator]
                return False
            if (i is not None) != (w is not None) or (i is not None and not i < w):  # type: ignore[operator]
                return False
    return not s.has_comms or naive_comms_ok(s, at)


def naive_comms_ok(s: Schedule, at: dict[tuple[Op, int, int], int]) -> bool:
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    recv_at = {}
    for r, p, a in s.iter_actions():
        if not a.op.is_comm:
            continue
        forward, sending = a.op in (Op.SEND_F, Op.RECV_F), a.op in (Op.SEND_F, Op.SEND_B)
        peer = s.next_stage(a.stage) if forward == sending else s.prev_stage(a.stage)
        if peer is None or s.stages[peer].rank == r:
            return False
        if sending:
            made = at.get((Op.F, a.stage, a.microbatch)) if forward else \
                at.get((Op.B, a.stage, a.microbatch), at.get((Op.I, a.stage, a.microbatch)))
            if made is None or made > p:
                return False
            message = ("F" if forward else "B", peer, a.microbatch)
            sent.setdefault((r, s.stages[peer].rank), []).append(message)
        else:
            key = ("F" if forward else "B", a.stage, a.microbatch)
            if key in recv_at:
                return False
            recv_at[key] = p
            received.setdefault((s.stages[peer].rank, r), []).append(key)
    if sent != received:
        return False
    for (op, stage, m), p in at.items():
        peer = s.prev_stage(stage) if op is Op.F else s.next_stage(stage) if op in (Op.B, Op.I) else None
        if peer is not None and s.stages[peer].rank != s.stages[stage].rank:
            got = recv_at.get(("F" if op is Op.F else "B", stage, m))
            if got is None or got > p:
                return False
    return True


BASES = [registry.build(n, 2, 4) for n in ("1f1b", "zbv", "dualpipe", "interleaved-1f1b")]
BASES += [lower(b) for b in BASES]


@st.composite
def mutants(draw: st.DrawFn) -> Schedule:
    base = draw(st.sampled_from(BASES))
    rows = [list(row) for row in base.actions]
    for _ in range(draw(st.integers(1, 2))):
        r = draw(st.integers(0, len(rows) - 1))
        if not rows[r]:
            continue
        i = draw(st.integers(0, len(rows[r]) - 1))
        kind = draw(st.sampled_from(["swap", "drop", "dup", "move", "mb"]))
        if kind == "swap":
            j = draw(st.integers(0, len(rows[r]) - 1))
            rows[r][i], rows[r][j] = rows[r][j], rows[r][i]
        elif kind == "drop":
            del rows[r][i]
        elif kind == "dup":
            rows[r].insert(draw(st.integers(0, len(rows[r]))), rows[r][i])
        elif kind == "move":
            rows[1 - r].insert(draw(st.integers(0, len(rows[1 - r]))), rows[r].pop(i))
        elif rows[r][i].op is not Op.OVERLAP_F_B:
            a = rows[r][i]
            rows[r][i] = Action(a.stage, a.op, draw(st.integers(0, 4)))
    return Schedule(base.name, base.num_ranks, base.num_microbatches, base.stages,
                    tuple(tuple(row) for row in rows))


@settings(max_examples=300, deadline=None)
@given(mutants())
def test_structure_check_agrees_with_a_naive_reading(schedule: Schedule) -> None:
    try:
        check_structure(schedule)
        accepted = True
    except ScheduleError:
        accepted = False
    assert accepted == naive_ok(schedule)
    if accepted:
        acyclic = nx.is_directed_acyclic_graph(happens_before_graph(schedule))
        assert (find_deadlock(schedule) is None) == acyclic


def _sharded_dualpipe() -> Schedule:
    from duplexpipe.schedules.shard import add_unshard_reshard

    return add_unshard_reshard(lower(registry.build("dualpipe", 2, 4)), 2, 1)


def _edit(schedule: Schedule, rank: int, row: list[str]) -> Schedule:
    rows = list(schedule.actions)
    rows[rank] = tuple(parse_action(t) for t in row)
    return Schedule("edited", schedule.num_ranks, schedule.num_microbatches, schedule.stages, tuple(rows))


def test_mis_ordered_gradient_collectives_are_a_named_cycle(tmp_path: Path) -> None:
    """DualPipe's two copies of a weight group reduce their gradients in one collective over both ranks: rank 0
    issuing its two in the other order than rank 1 deadlocks, and the cycle names both."""
    from duplexpipe.schedules.ir import load_json, save_json

    good = _sharded_dualpipe()
    row = [str(a) for a in good.actions[0]]
    assert row[-2:] == ["0REDUCE_GRAD", "3REDUCE_GRAD"]
    path = tmp_path / "swapped.json"
    save_json(_edit(good, 0, row[:-2] + ["3REDUCE_GRAD", "0REDUCE_GRAD"]), str(path))
    with pytest.raises(ScheduleError) as err:
        verify(load_json(str(path)))
    text = str(err.value)
    assert ("rank 0 blocked at 3REDUCE_GRAD waiting for 1REDUCE_GRAD (one collective with it) on rank 1; "
            "rank 1 blocked at 2REDUCE_GRAD waiting for 0REDUCE_GRAD (one collective with it) on rank 0") in text
    assert "cycle: rank 0: 3REDUCE_GRAD -> 0REDUCE_GRAD => rank 1: 2REDUCE_GRAD -> 1REDUCE_GRAD" in text


def test_a_gradient_collective_before_a_send_its_peer_needs_is_a_cycle_with_the_message() -> None:
    good = _sharded_dualpipe()
    row = [str(a) for a in good.actions[0] if str(a) != "3REDUCE_GRAD"]
    row.insert(row.index("3SEND_B3"), "3REDUCE_GRAD")
    with pytest.raises(ScheduleError) as err:
        verify(_edit(good, 0, row))
    text = str(err.value)
    assert "rank 0 blocked at 3REDUCE_GRAD waiting for 1REDUCE_GRAD (one collective with it) on rank 1" in text
    assert "rank 1 blocked at 2I3 waiting for 3SEND_B3 on rank 0" in text


@pytest.mark.parametrize("change,needle", [
    (lambda r: [t for t in r if t != "0UNSHARD"], "0F0 at rank 0, position 0: stage 0 is sharded here"),
    (lambda r: ["0UNSHARD"] + r, "0UNSHARD at rank 0, position 1: stage 0 is already unsharded (by the UNSHARD at "
     "position 0"),
    (lambda r: ["0RESHARD"] + r, "0RESHARD at rank 0, position 0: stage 0 is not unsharded here"),
    (lambda r: ["0UNSHARD", "0RESHARD"] + r[1:], "0RESHARD at rank 0, position 1: the episode from 0UNSHARD at "
     "position 0 has no compute of stage 0"),
    (lambda r: [t for t in r if t != "0RESHARD"], "0UNSHARD at rank 0, position 0: stage 0 is still unsharded at "
     "the end of rank 0's list"),
    (lambda r: [t for t in r if t != "0REDUCE_GRAD"], "missing 0REDUCE_GRAD on rank 0"),
    (lambda r: r + ["0REDUCE_GRAD"], "0REDUCE_GRAD at rank 0, position 19: duplicate (no B or W of stage 0 since the "
     "one at position 17)"),
    (lambda r: r[:2] + ["0REDUCE_GRAD"] + [t for t in r[2:] if t != "0REDUCE_GRAD"],
     "0REDUCE_GRAD at rank 0, position 2: before the last gradient of stage 0: 0 of its 4 B or W ran before it"),
    (lambda r: r + ["0UNSHARD", "0B3", "0RESHARD"], "0B3 at rank 0, position 20: duplicate backward"),
    (lambda r: r[:-1] + ["1UNSHARD"], "stage 1 runs on rank 1, not 0"),
    (lambda r: r[:-2] + ["0UNSHARD", "0W0", "0RESHARD"], "0W0 at rank 0, position 18: weight gradient after a full"),
])
def test_zero3_actions_are_checked(change: Callable[[list[str]], list[str]], needle: str) -> None:
    from duplexpipe.schedules.shard import add_unshard_reshard

    good = add_unshard_reshard(lower(registry.build("1f1b", 2, 4)), 1, 0)
    assert [str(a) for a in good.actions[0]][-3:] == ["0B3", "0REDUCE_GRAD", "0RESHARD"]
    with pytest.raises(ScheduleError) as err:
        verify(_edit(good, 0, change([str(a) for a in good.actions[0]])))
    assert needle in str(err.value)


def test_windowed_gradient_reductions_are_checked() -> None:
    """A window of one on ZBV reduces a stage after each episode with a gradient: several REDUCE_GRADs verify; one
    with no B or W since the last, or a gradient left after the last, is refused."""
    from duplexpipe.schedules.shard import add_unshard_reshard

    good = add_unshard_reshard(lower(registry.build("zbv", 2, 4)), 1, 1)
    verify(good)
    row = [str(a) for a in good.actions[0]]
    spots = [i for i, t in enumerate(row) if t == "0REDUCE_GRAD"]
    assert len(spots) > 1
    with pytest.raises(ScheduleError, match="0REDUCE_GRAD at rank 0, position .*: duplicate \\(no B or W of stage 0"):
        verify(_edit(good, 0, row[:spots[0] + 1] + ["0REDUCE_GRAD"] + row[spots[0] + 1:]))
    with pytest.raises(ScheduleError, match="a gradient of stage 0 after its last REDUCE_GRAD"):
        verify(_edit(good, 0, row[:spots[-1]] + row[spots[-1] + 1:]))
    verify(_edit(good, 0, row[:spots[0]] + row[spots[0] + 1:]))  # the next one reduces both episodes' gradients


def test_torch_lowering_of_unshard_and_reduce_grad_verifies() -> None:
    """Where torch's _add_unshard_reshard and _add_reduce_grad put them: all unshards first, REDUCE_GRAD right after
    the last backward, RESHARD before the next compute."""
    rows = [["0UNSHARD", "0F0", "0F1", "0B0", "0B1", "0REDUCE_GRAD", "0RESHARD"],
            ["1UNSHARD", "1F0", "1B0", "1F1", "1B1", "1REDUCE_GRAD", "1RESHARD"]]
    verify(schedule_from_rows([[parse_action(t) for t in row] for row in rows], "torch-like"))
