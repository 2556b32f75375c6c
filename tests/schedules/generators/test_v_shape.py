"""Tests for the V-Half and V-Min generators."""

from __future__ import annotations

from typing import Any

import pytest

from duplexpipe.schedules import registry
from duplexpipe.schedules.compare import compare_rows
from duplexpipe.schedules.generators.v_shape import PERIOD, V_HALF, V_MIN, block_slots, v_half, v_min
from duplexpipe.schedules.generators.zero_bubble import zbv
from duplexpipe.schedules.ir import Op, format_action
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.verify import verify

COST = CostModel(f=1, b=2, w=1, stage_scale=True)
"""The command line's convention: costs per 1/P of the model, so every V stage takes half."""
PAPER_PEAK = {V_HALF: lambda p: (p + 2) // 2, V_MIN: lambda p: (p + 4) // 3}
"""Activation peak per rank in 1F1B-stage units (the paper's table, for M >= 2P)."""


def memory_peak(name: str, ranks: int, mbs: int) -> float:
    """The simulated peak over ranks in 1F1B-stage activations (compare's act_mem)."""
    (row,), _ = compare_rows(ranks, mbs, COST, [name])
    return float(row["peak_activation_memory"])


@pytest.mark.parametrize("name", [V_HALF, V_MIN])
def test_v_placement_and_block_slots_never_collide(name: str) -> None:
    s = registry.build(name, 4, 8)
    assert s.stages == zbv(4, 8).stages
    for ranks in range(2, 25):
        for rank in range(ranks):
            slots = block_slots(name, ranks, rank)
            assert len({t % PERIOD for t in slots}) == 4, (ranks, rank, slots)


@pytest.mark.parametrize("name", [V_HALF, V_MIN])
@pytest.mark.parametrize(("ranks", "mbs"), [(2, 1), (2, 5), (3, 7), (4, 8), (5, 3), (6, 12), (8, 16), (9, 20)])
def test_verified_complete_and_at_the_papers_peak(name: str, ranks: int, mbs: int) -> None:
    s = registry.build(name, ranks, mbs)
    verify(s)
    for row in s.actions:
        assert sorted((a.stage, a.op.value, a.microbatch) for a in row) == sorted(
            (stage, op, m) for stage in {a.stage for a in row} for op in "FIW" for m in range(mbs))
    peak = memory_peak(name, ranks, mbs)
    expected = PAPER_PEAK[name](ranks)
    assert peak == expected if mbs >= 2 * ranks else peak <= expected


def test_block_order_on_the_last_rank() -> None:
    # V-Min on the fold rank: the up stage's F right after the down stage's, one block every six slots.
    assert [format_action(a) for a in v_min(4, 8).actions[3][:5]] == ["3F0", "4F0", "3F1", "4F1", "4I0"]
    # Every W follows its own I on its rank.
    for s in (v_half(8, 16), v_min(8, 16)):
        for row in s.actions:
            done: set[tuple[int, int]] = set()
            for a in row:
                if a.op is Op.W:
                    assert (a.stage, a.microbatch) in done
                if a.op is Op.I:
                    done.add((a.stage, a.microbatch))


def test_memory_against_1f1b_at_p8_m16() -> None:
    """Half and a third of 1F1B's peak asymptotically; at P=8 the paper's block constants give 5/8 and 4/8."""
    one_f_one_b = memory_peak("1f1b", 8, 16)
    assert one_f_one_b == 8
    assert memory_peak(V_HALF, 8, 16) / one_f_one_b == pytest.approx(5 / 8)
    assert memory_peak(V_MIN, 8, 16) / one_f_one_b == pytest.approx(4 / 8)
    assert memory_peak("zbv", 8, 16) / one_f_one_b == 1
    # The ratios the paper names hold once the constants fade: P=24 gives 13/24 and 9/24.
    assert memory_peak(V_HALF, 24, 48) / memory_peak("1f1b", 24, 48) <= 0.55
    assert memory_peak(V_MIN, 24, 48) / memory_peak("1f1b", 24, 48) <= 0.40


def test_makespan_between_zbv_and_1f1b() -> None:
    for ranks, mbs in ((4, 8), (8, 16), (8, 32)):
        spans = {n: simulate(registry.build(n, ranks, mbs), COST).makespan for n in ("1f1b", "zbv", V_HALF, V_MIN)}
        assert spans["zbv"] < spans[V_HALF] < spans["1f1b"], spans
        assert spans["zbv"] < spans[V_MIN] < spans["1f1b"], spans


@pytest.mark.parametrize(("fn", "ranks", "mbs", "needle"), [
    (v_half, 1, 4, "v-half needs num_ranks >= 2, got num_ranks=1"),
    (v_min, 4, 0, "v-min needs num_microbatches >= 1, got num_microbatches=0"),
    (v_min, 2, 1.5, "v-min needs an integer num_microbatches, got num_microbatches=1.5"),
])
def test_bad_arguments(fn: Any, ranks: object, mbs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        fn(ranks, mbs)
    with pytest.raises(ValueError, match="no V-shape building block named 'v-max'"):
        block_slots("v-max", 4, 0)
