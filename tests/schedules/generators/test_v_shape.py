"""Tests for the V-Half and V-Min generators."""

from __future__ import annotations

import math
from typing import Any

import pytest

from duplexpipe.schedules import registry
from duplexpipe.schedules.compare import compare_rows
from duplexpipe.schedules.generators.v_shape import (
    MIN_PERIOD,
    V_HALF,
    V_MIN,
    activation_bound,
    v_block,
    v_half,
    v_min,
)
from duplexpipe.schedules.generators.zero_bubble import zbv
from duplexpipe.schedules.ir import Op, format_action
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.verify import verify

COST = CostModel(f=1, b=2, w=1, stage_scale=True)
"""The command line's convention: costs per 1/P of the model, so every V stage takes half."""


def memory_peak(name: str, ranks: int, mbs: int) -> float:
    """The simulated peak over ranks in 1F1B-stage activations (compare's act_mem)."""
    (row,), _ = compare_rows(ranks, mbs, COST, [name])
    return float(row["peak_activation_memory"])


def test_bounds_are_half_and_a_third_of_1f1b_in_v_stage_activations() -> None:
    # 1F1B's rank 0 holds P stage activations = 2P V-stage ones.
    assert [activation_bound(V_HALF, p) for p in (2, 3, 8, 9)] == [2, 3, 8, 9]
    assert [activation_bound(V_MIN, p) for p in (2, 3, 8, 9)] == [2, 2, 6, 6]


@pytest.mark.parametrize("name", [V_HALF, V_MIN])
def test_blocks_never_collide_and_keep_their_bound(name: str) -> None:
    assert registry.build(name, 4, 8).stages == zbv(4, 8).stages
    for ranks in range(2, 17):
        bound = activation_bound(name, ranks)
        block = v_block(ranks, bound)
        assert block.peak <= bound, (ranks, block)
        for slots in block.slots:
            assert len({t % block.period for t in slots}) == 4, (ranks, block)


def test_v_half_keeps_the_period_of_a_bubble_free_block_from_six_ranks() -> None:
    # (4P+4)/6 < P from P=3, yet whole activations put P=3 and P=5 over it at period 6 (P=4 fits);
    # V-Min's bound never fits period 6: (4P+4)/6 > 2P/3.
    assert [v_block(p, activation_bound(V_HALF, p)).period for p in (3, 4, 5)] == [9, 6, 8]
    for ranks in range(6, 17):
        assert v_block(ranks, activation_bound(V_HALF, ranks)).period == MIN_PERIOD
        assert v_block(ranks, activation_bound(V_MIN, ranks)).period > MIN_PERIOD
    assert v_block(8, 6).period == 8


@pytest.mark.parametrize("name", [V_HALF, V_MIN])
@pytest.mark.parametrize(("ranks", "mbs"), [(2, 1), (2, 5), (3, 7), (4, 8), (5, 3), (6, 12), (8, 16), (9, 20)])
def test_verified_complete_and_within_the_bound(name: str, ranks: int, mbs: int) -> None:
    s = registry.build(name, ranks, mbs)
    verify(s)
    for row in s.actions:
        assert sorted((a.stage, a.op.value, a.microbatch) for a in row) == sorted(
            (stage, op, m) for stage in {a.stage for a in row} for op in "FIW" for m in range(mbs))
    peak = memory_peak(name, ranks, mbs)  # 1F1B-stage units: a V stage counts half
    block = v_block(ranks, activation_bound(name, ranks))
    assert peak <= activation_bound(name, ranks) / 2
    if mbs >= 2 * ranks:
        assert peak == block.peak / 2


def test_block_order_on_the_fold_rank() -> None:
    # V-Half on the fold rank: the up stage's F right after the down stage's, one block every six slots.
    assert [format_action(a) for a in v_half(4, 8).actions[3][:5]] == ["3F0", "4F0", "3F1", "4F1", "4I0"]
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
    """Half and a third of 1F1B's peak, rounded up to whole V-stage activations."""
    one_f_one_b = memory_peak("1f1b", 8, 16)
    assert one_f_one_b == 8
    assert memory_peak(V_HALF, 8, 16) / one_f_one_b == pytest.approx(4 / 8)
    assert memory_peak(V_MIN, 8, 16) / one_f_one_b == pytest.approx(3 / 8)
    assert memory_peak("zbv", 8, 16) / one_f_one_b == 1
    for ranks in (5, 12, 24):
        ratio = memory_peak(V_MIN, ranks, 2 * ranks) / memory_peak("1f1b", ranks, 2 * ranks)
        assert ratio <= math.ceil(2 * ranks / 3) / (2 * ranks)


def test_makespans_pay_for_memory() -> None:
    for ranks, mbs in ((4, 8), (8, 16), (8, 32)):
        spans = {n: simulate(registry.build(n, ranks, mbs), COST).makespan for n in ("1f1b", "zbv", V_HALF, V_MIN)}
        assert spans["zbv"] < spans[V_HALF] < spans["1f1b"], spans
        assert spans[V_HALF] < spans[V_MIN], spans


@pytest.mark.parametrize(("fn", "ranks", "mbs", "needle"), [
    (v_half, 1, 4, "v-half needs num_ranks >= 2, got num_ranks=1"),
    (v_min, 4, 0, "v-min needs num_microbatches >= 1, got num_microbatches=0"),
    (v_min, 2, 1.5, "v-min needs an integer num_microbatches, got num_microbatches=1.5"),
])
def test_bad_arguments(fn: Any, ranks: object, mbs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        fn(ranks, mbs)
    with pytest.raises(ValueError, match="no V-shape building block named 'v-max'"):
        activation_bound("v-max", 4)
    with pytest.raises(ValueError, match="an activation bound >= 2, got num_ranks=4, bound=1"):
        v_block(4, 1)
