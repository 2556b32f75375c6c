"""Tests of the ZeRO-3 pass (schedules.shard): episodes under a window and a lookahead, REDUCE_GRAD placement, its
errors, and that every result verifies, for every built-in schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.shard import (
    add_unshard_reshard,
    episodes,
    grad_reductions,
    gradient_deltas,
    gradient_peak,
    residency,
    weight_group_ranks,
)
from duplexpipe.schedules.verify import verify

SIZES = [(2, 4), (4, 8), (3, 6)]
FSDP = (Op.UNSHARD, Op.RESHARD, Op.REDUCE_GRAD)


def _built() -> list[tuple[str, int, int]]:
    return [(n, p, m) for n in registry.names() for p, m in SIZES if registry.check(n, p, m) is None]


def _most(schedule: Schedule) -> int:
    return max(len(schedule.stages_of_rank(r)) for r in range(schedule.num_ranks))


def _pairs_split(schedule: Schedule, window: int) -> Schedule:
    """`schedule` with each F&B pair of more than `window` stages written as its two parts."""
    def parts(a: Action) -> tuple[Action, ...]:
        return a.compute_parts() if len({p.stage for p in a.compute_parts()}) > window else (a,)
    return replace(schedule, actions=tuple(tuple(p for a in row for p in parts(a)) for row in schedule.actions))


def _needs(schedule: Schedule, rank: int) -> list[int]:
    return [len({p.stage for p in a.compute_parts()}) for a in schedule.actions[rank] if a.op.is_compute]


def _episodes_with_grads(schedule: Schedule, rank: int) -> dict[int, int]:
    """Per stage of `rank`: its episodes (UNSHARD to RESHARD) that ran a B or W of it."""
    out = dict.fromkeys(schedule.stages_of_rank(rank), 0)
    dirty: set[int] = set()
    for action in schedule.actions[rank]:
        if action.op.is_compute:
            dirty |= {p.stage for p in action.compute_parts() if p.op is Op.B or p.op is Op.W}
        elif action.op is Op.RESHARD and action.stage in dirty:
            dirty.discard(action.stage)
            out[action.stage] += 1
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_built()), st.integers(1, 4), st.integers(0, 6), st.booleans())
def test_any_schedule_window_and_lookahead_verify(case: tuple[str, int, int], window: int, lookahead: int,
                                                  lowered_first: bool) -> None:
    name, ranks, microbatches = case
    base = registry.build(name, ranks, microbatches)
    window = min(window, _most(base))
    out = add_unshard_reshard(lower(base) if lowered_first else base, window, lookahead)
    verify(out)
    verify(lower(out))
    assert out.without_fsdp() == _pairs_split(lower(base) if lowered_first else base, window)
    reduces = grad_reductions(out)
    joint = {s for s, ranks in enumerate(weight_group_ranks(out)) if len(ranks) > 1}
    for rank in range(ranks):
        mine = out.stages_of_rank(rank)
        with_grads = _episodes_with_grads(out, rank)
        for s in mine:  # per window: one per stage per step, or one per episode that ran a B or W (mirrors: one)
            assert reduces[s] == (1 if window >= len(mine) or s in joint else with_grads[s]), (rank, s)
    counts = episodes(out)
    assert counts == {s: sum(a == Action.on_stage(s, Op.RESHARD) for _, _, a in out.iter_actions())
                      for s in range(out.num_stages)}
    for rank in range(ranks):
        held = residency(out, rank)
        assert max(held, default=0) <= window
        if window == len(out.stages_of_rank(rank)):
            assert all(counts[s] == 1 for s in out.stages_of_rank(rank))


@pytest.mark.parametrize("case", _built())
def test_window_of_all_stages_gathers_once_per_stage(case: tuple[str, int, int]) -> None:
    base = registry.build(*case)
    out = add_unshard_reshard(base, _most(base), 2)
    assert set(episodes(out).values()) == {1}
    assert set(grad_reductions(out).values()) == {1}  # one reduce-scatter per stage per step, never 2 x M
    verify(out)


def test_window_one_on_zbv_reshards_between_stages_and_lookahead_waits_for_room() -> None:
    base = registry.build("zbv", 2, 4)
    out = add_unshard_reshard(base, 1, 3)
    assert " ".join(map(str, out.actions[0][:6])) == "0UNSHARD 0F0 0F1 0F2 0RESHARD 3UNSHARD"
    assert episodes(out) == {0: 4, 1: 7, 2: 6, 3: 3}
    assert residency(out, 0) == [1] * len(residency(out, 0))


def test_window_one_reduces_each_episode_with_a_gradient_before_its_reshard() -> None:
    """ZBV under a window of 1: a REDUCE_GRAD right before each RESHARD whose episode ran a B or W (not after a
    forward-only episode); under a window of 2, one per stage at its last gradient."""
    out = add_unshard_reshard(registry.build("zbv", 2, 4), 1, 1)
    row = [str(a) for a in out.actions[0]]
    assert row[:5] == ["0UNSHARD", "0F0", "0F1", "0F2", "0RESHARD"]  # forwards only: nothing to reduce
    for at, text in enumerate(row):
        if text.endswith("REDUCE_GRAD"):
            assert row[at + 1] == text.replace("REDUCE_GRAD", "RESHARD")
    assert grad_reductions(out) == {s: _episodes_with_grads(out, out.stages[s].rank)[s] for s in range(4)}
    assert all(grad_reductions(out)[s] > 1 for s in range(4))
    assert set(grad_reductions(add_unshard_reshard(registry.build("zbv", 2, 4), 2, 1)).values()) == {1}


def test_gradient_peak_is_one_stage_whole_beside_the_shards_under_a_window_of_one() -> None:
    """The rule of the gradient bytes (`gradient_deltas`): a stage's gradient whole from its first B or W since its
    last REDUCE_GRAD to the next, its shard after its first; ZBV's rank holds two stages of `w` bytes."""
    w, d = 100.0, 4
    whole, shard = [w] * 4, [w / d] * 4
    base = registry.build("zbv", 2, 4)
    for rank in range(2):
        assert gradient_peak(add_unshard_reshard(base, 1, 1), rank, whole, shard) == w + 2 * w / d
        assert gradient_peak(add_unshard_reshard(base, 2, 1), rank, whole, shard) == 2 * w
        assert gradient_peak(base, rank, whole, shard) == 2 * w  # no REDUCE_GRAD: whole to the end
    row = add_unshard_reshard(base, 1, 1).actions[0]
    deltas = gradient_deltas(((a, float(i), float(i)) for i, a in enumerate(row)), whole, shard)
    assert sum(delta for _, delta in deltas) == 2 * w / d  # the step ends with the two shards only


def test_lookahead_issues_the_unshard_that_many_computes_ahead() -> None:
    base = registry.build("zbv", 2, 4)
    row = [str(a) for a in add_unshard_reshard(base, 2, 2).actions[0]]
    assert row[:5] == ["0UNSHARD", "0F0", "3UNSHARD", "0F1", "0F2"]  # 3F0 is the fourth compute
    assert row[row.index("3UNSHARD") + 1:].index("3F0") == 2
    none = [str(a) for a in add_unshard_reshard(base, 2, 0).actions[0]]
    assert none[none.index("3UNSHARD") + 1] == "3F0"


def test_reduce_grad_follows_the_last_gradient_and_its_sends() -> None:
    out = add_unshard_reshard(lower(registry.build("1f1b", 2, 4)), 1, 1)
    row = [str(a) for a in out.actions[0]]
    assert row[-3:] == ["0B3", "0REDUCE_GRAD", "0RESHARD"]
    row1 = [str(a) for a in out.actions[1]]
    assert row1[row1.index("1B3"):] == ["1B3", "1SEND_B3", "1REDUCE_GRAD", "1RESHARD"]


def test_dualpipe_reduces_each_weight_group_together_at_the_end() -> None:
    base = registry.build("dualpipe", 4, 8)
    assert weight_group_ranks(base)[0] == (0, 3) and weight_group_ranks(base)[4] == (0, 3)
    out = add_unshard_reshard(base, 1, 1)
    assert [str(a) for a in out.actions[0][-2:]] == ["0REDUCE_GRAD", "7REDUCE_GRAD"]  # groups 0 then 3
    assert [str(a) for a in out.actions[3][-2:]] == ["4REDUCE_GRAD", "3REDUCE_GRAD"]
    verify(out)


def test_pairs_of_two_stages_run_as_their_parts_under_a_window_of_one() -> None:
    """Under a window of 1 a DualPipeV F&B pair of two stages becomes its forward then its backward, in place (the
    messages keep their order), each holding one stage; under a window of 2 the pairs stay."""
    base = lower(registry.build("dualpipev", 2, 4))
    out = add_unshard_reshard(base, 1, 1)
    verify(out)
    for rank in range(2):
        assert set(residency(out, rank)) == {1} and set(_needs(out, rank)) == {1}
        expected = [p for a in base.actions[rank] for p in a.compute_parts() if a.op.is_compute]
        assert [a for a in out.actions[rank] if a.op.is_compute] == expected
        messages = [a for a in base.actions[rank] if not a.op.is_compute]
        assert [a for a in out.actions[rank] if not a.op.is_compute and a.op not in FSDP] == messages
    kept = add_unshard_reshard(base, 2, 1)
    assert any(a.op is Op.OVERLAP_F_B for row in kept.actions for a in row)
    assert max(residency(kept, 0)) == 2


@pytest.mark.parametrize("window,lookahead,needle", [
    (0, 1, "from 1 to 2"), (3, 1, "from 1 to 2"), (True, 1, "got True"), (1.0, 1, "got 1.0"),
    (1, -1, "lookahead must be a whole number of compute actions >= 0, got -1"),
])
def test_bad_window_or_lookahead(window: int, lookahead: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        add_unshard_reshard(registry.build("zbv", 2, 4), window, lookahead)


def test_a_schedule_with_these_actions_is_refused() -> None:
    once = add_unshard_reshard(registry.build("1f1b", 2, 4), 1, 0)
    with pytest.raises(ScheduleError, match="already holds UNSHARD/RESHARD/REDUCE_GRAD"):
        add_unshard_reshard(once, 1, 0)
    assert add_unshard_reshard(once.without_fsdp(), 1, 0) == once


def test_episodes_of_a_schedule_without_them_are_zero() -> None:
    assert episodes(registry.build("1f1b", 2, 4)) == {0: 0, 1: 0}
    assert residency(registry.build("zbv", 2, 4), 0) == [2] * 24  # F, I and W of 2 stages x 4


def test_gradients_are_windowed_where_they_hold_fewer_bytes() -> None:
    """ZBV, two stages per rank, a window of one: at dp=2 a whole gradient beside two half shards weighs as much as
    two whole gradients, so one REDUCE_GRAD per stage per step; from dp=3 one per episode with a backward; a choice
    (reshard_gradients) overrides; a window of all never windows them; dp is checked."""
    base = registry.build("zbv", 2, 4)

    def reductions(**kw: object) -> int:
        return sum(a.op is Op.REDUCE_GRAD for _, _, a in add_unshard_reshard(base, 1, 1, **kw).iter_actions())
    assert reductions(dp=2) == base.num_stages == reductions(dp=4, reshard_gradients=False)
    assert reductions(dp=3) == reductions(dp=4) == reductions() == reductions(dp=2, reshard_gradients=True) > 4
    every = add_unshard_reshard(base, 2, 1, dp=8, reshard_gradients=True)
    assert sum(a.op is Op.REDUCE_GRAD for _, _, a in every.iter_actions()) == base.num_stages
    with pytest.raises(ValueError, match="dp must be a whole number of data-parallel replicas >= 1"):
        add_unshard_reshard(base, 1, 1, dp=0)
