"""Tests for the ZB-H1, ZB-H2 and ZB-V generators."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from duplexpipe.schedules.generators.one_f_one_b import one_f_one_b
from duplexpipe.schedules.generators.zero_bubble import zb_h1, zb_h2, zbv
from duplexpipe.schedules.ir import Action, Op, format_action
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.verify import verify


def live_peak(row: tuple[Action, ...]) -> int:
    """Most activations held at once along one list (an F holds until its B or W)."""
    live = peak = 0
    for a in row:
        live += 1 if a.op is Op.F else -1 if a.op in (Op.B, Op.W) else 0
        peak = max(peak, live)
    return peak


def torch_rows(cls_name: str, ranks: int, mbs: int, **attrs: Any) -> list[list[str]]:
    """The compute order torch's schedule class computes for every rank (skips if unavailable)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=mbs, **attrs)
    try:
        method = getattr(schedules, cls_name)._calculate_single_rank_operations
        return [[str(a) for a in method(fake, r) if a is not None] for r in range(ranks)]
    except (AttributeError, TypeError) as exc:
        pytest.skip(f"torch's {cls_name} order is not available: {exc}")


@pytest.mark.parametrize(("ranks", "mbs"), [(4, 8), (3, 3), (5, 11), (4, 2)])
def test_zb_h1_is_1f1b_with_split_backward(ranks: int, mbs: int) -> None:
    s, base = zb_h1(ranks, mbs), one_f_one_b(ranks, mbs)
    for row, base_row in zip(s.actions, base.actions, strict=True):
        assert not any(a.op is Op.B for a in row)
        as_1f1b = [Action(a.stage, Op.B, a.microbatch) if a.op is Op.I else a for a in row if a.op is not Op.W]
        assert as_1f1b == list(base_row)


def test_zb_h1_defers_w_by_rank_and_keeps_1f1b_peak() -> None:
    ranks, mbs = 4, 8
    s = zb_h1(ranks, mbs)
    for rank, row in enumerate(s.actions):
        for pos, a in enumerate(row):
            if a.op is Op.I and a.microbatch >= rank:
                assert row[pos + 1] == Action(rank, Op.W, a.microbatch - rank)
        tail = [format_action(a) for a in row[len(row) - rank:]]
        assert tail == [f"{rank}W{m}" for m in range(mbs - rank, mbs)]
        assert live_peak(row) == ranks  # 1F1B's peak (rank 0's), on every rank


def test_zb_h1_matches_torch_zb1p_with_one_stage_per_rank() -> None:
    for ranks, mbs in ((2, 4), (4, 8), (4, 12), (3, 3)):
        theirs = torch_rows("ScheduleInterleavedZeroBubble", ranks, mbs, n_local_stages=1,
                            microbatches_per_round=ranks)
        assert [[format_action(a) for a in row] for row in zb_h1(ranks, mbs).actions] == theirs


@pytest.mark.parametrize(("ranks", "mbs"), [(4, 8), (3, 3), (5, 11), (4, 2), (1, 3)])
def test_zb_h2_doubles_the_warmup_and_defers_w_by_twice_the_rank(ranks: int, mbs: int) -> None:
    s = zb_h2(ranks, mbs)
    verify(s)
    for rank, row in enumerate(s.actions):
        ops = [a.op for a in row]
        warmup = min(2 * (ranks - 1 - rank) + 1, mbs)
        assert ops[:warmup] == [Op.F] * warmup and (warmup == mbs or ops[warmup] is Op.I)
        i_done = 0
        for a in row:  # each W runs the oldest deferred microbatch, 2r inputs-gradients behind
            if a.op is Op.I:
                i_done += 1
            elif a.op is Op.W and i_done < mbs:
                assert a.microbatch == i_done - 1 - 2 * rank
        assert live_peak(row) == min(2 * ranks - 1, mbs)


@pytest.mark.parametrize("latency", [0.0, 0.5, 1.0])
def test_zb_h2_reaches_the_lower_bound_where_zb_h1_does_not(latency: float) -> None:
    cost = CostModel(f=1, b=2, w=1, latency=latency)
    for ranks, mbs in ((4, 8), (4, 16), (8, 32)):
        bound = (ranks - 1) * (1 + latency) + mbs * 3  # (P-1)(F + latency) + M(F + B)
        assert simulate(zb_h2(ranks, mbs), cost).makespan == pytest.approx(bound)
        h1 = simulate(zb_h1(ranks, mbs), cost).makespan
        assert h1 == pytest.approx(bound) if latency == 0 else h1 > bound


def test_zbv_v_shape_and_start() -> None:
    s = zbv(4, 8)
    assert [info.rank for info in s.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [s.stages_of_rank(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # Rank 0 warms up with 2P-1 forwards of stage 0; the last rank alternates its two stages.
    assert [format_action(a) for a in s.actions[0][:8]] == [f"0F{m}" for m in range(7)] + ["7F0"]
    assert [format_action(a) for a in s.actions[3][:4]] == ["3F0", "4F0", "3F1", "4F1"]
    assert all(live_peak(row) == 8 for row in s.actions)  # 2P chunk activations


@pytest.mark.parametrize(("ranks", "mbs"), [(2, 1), (2, 3), (4, 3), (4, 8), (3, 10), (5, 9)])
def test_zbv_matches_torch_zbv(ranks: int, mbs: int) -> None:
    theirs = torch_rows("ScheduleZBVZeroBubble", ranks, mbs, num_stages=2 * ranks)
    assert [[format_action(a) for a in row] for row in zbv(ranks, mbs).actions] == theirs


@pytest.mark.parametrize(("fn", "ranks", "mbs", "needle"), [
    (zb_h1, 0, 4, "zb-h1 needs num_ranks >= 1, got num_ranks=0"),
    (zb_h1, 2, 0, "zb-h1 needs num_microbatches >= 1, got num_microbatches=0"),
    (zb_h2, 0, 4, "zb-h2 needs num_ranks >= 1, got num_ranks=0"),
    (zb_h2, 2, "3", "zb-h2 needs an integer num_microbatches, got num_microbatches='3'"),
    (zbv, 1, 4, "zbv needs num_ranks >= 2, got num_ranks=1"),
    (zbv, 2, 1.5, "zbv needs an integer num_microbatches, got num_microbatches=1.5"),
])
def test_bad_arguments(fn: Any, ranks: object, mbs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        fn(ranks, mbs)
