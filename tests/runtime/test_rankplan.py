"""RankPlan: receives hoisted ahead of the list keep every guarantee the list had, and the steps that run
them still match the single-process reference (one spawn of 4 gloo ranks)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _executor_cases import _grad_errors, _inputs, stage_setup
from models import loss_fn, make_batch, reference

from duplexpipe.runtime import PipelineRuntime, RuntimeConfig
from duplexpipe.runtime.rankplan import RECEIVES, RankPlan, forward_only
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build, names

NAMES = names()
DEPTHS = (1, 2, 4, -1)
WORLD = 4
SPAWN_TIMEOUT_S = 180
TIGHT = 1e-12
"""float64 pipeline vs float64 reference: only summation order differs."""


def _peer(action: Action, layout: Layout) -> int:
    feeder = layout.prv[action.stage] if action.op is Op.RECV_F else layout.nxt[action.stage]
    return layout.rank[feeder]


def _received(actions: tuple[Action, ...], layout: Layout) -> list[Counter[int]]:
    """After each non-receive action of `actions` (and before the first): receives listed so far, per peer."""
    seen: Counter[int] = Counter()
    out: list[Counter[int]] = []
    for action in actions:
        if action.op in RECEIVES:
            seen[_peer(action, layout)] += 1
        else:
            out.append(Counter(seen))
    out.append(Counter(seen))
    return out


def _plans(name: str, P: int) -> list[tuple[Schedule, int, RankPlan]]:
    schedule = lower(build(name, P, 2 * P))
    return [(schedule, rank, RankPlan.of(schedule, rank)) for rank in range(P)]


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_hoisting_moves_only_receives_earlier_in_peer_order(name: str, P: int, depth: int) -> None:
    for _, rank, plan in _plans(name, P):
        moved = plan.hoisted(depth)
        assert Counter(moved.actions) == Counter(plan.actions), rank
        assert [a for a in moved.actions if a.op not in RECEIVES] == [a for a in plan.actions if a.op not in RECEIVES]
        for peer in range(P):
            order = [a for a in plan.actions if a.op in RECEIVES and _peer(a, plan.layout) == peer]
            assert [a for a in moved.actions if a.op in RECEIVES and _peer(a, plan.layout) == peer] == order
        for old, new in zip(_received(plan.actions, plan.layout), _received(moved.actions, plan.layout), strict=True):
            for peer in set(old) | set(new):
                assert new[peer] >= old[peer], (rank, peer)  # never later than listed
                if depth > 0:
                    assert new[peer] <= old[peer] + depth, (rank, peer)  # at most `depth` ahead


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_every_receive_is_at_the_start_with_a_negative_depth(name: str, P: int) -> None:
    for _, rank, plan in _plans(name, P):
        actions = plan.hoisted(-1).actions
        count = sum(1 for a in actions if a.op in RECEIVES)
        assert all(a.op in RECEIVES for a in actions[:count]), rank


@pytest.mark.parametrize("name", NAMES)
def test_hoisted_plan_marks_the_same_actions_final(name: str) -> None:
    for _, rank, plan in _plans(name, 4):
        for depth in DEPTHS:
            moved = plan.hoisted(depth)
            assert {moved.actions[p]: s for p, s in moved.grads_final.items()} == \
                {plan.actions[p]: s for p, s in plan.grads_final.items()}, (rank, depth)
            for old, new, actions, new_actions in (
                    (plan.losses_final, moved.losses_final, plan.actions, moved.actions),
                    (plan.eval_losses_final, moved.eval_losses_final, plan.eval_actions, moved.eval_actions)):
                assert (old is None and new is None) or (old is not None and new is not None
                                                         and actions[old] == new_actions[new]), (rank, depth)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_losses_final_is_the_position_of_the_last_loss_or_none(name: str, P: int) -> None:
    for schedule, rank, plan in _plans(name, P):
        for actions, at in ((plan.actions, plan.losses_final), (plan.eval_actions, plan.eval_losses_final)):
            losses = [pos for pos, a in enumerate(actions)
                      if any(p.op is Op.F and schedule.is_last(p.stage) for p in a.compute_parts())]
            assert at == (losses[-1] if losses else None), rank
        assert (plan.losses_final is None) == (not plan.lasts), rank


def test_lookahead_must_be_an_int() -> None:
    with pytest.raises(ValueError, match="recv_lookahead"):
        RuntimeConfig(recv_lookahead=1.5)  # type: ignore[arg-type]


def _lookahead_case(name: str, depth: int) -> dict[str, Any]:
    """Three same-shaped float64 steps (the last two run the hoisted list) and an evaluate."""
    rank, M = dist.get_rank(), 8
    schedule, parts, modules = stage_setup(name, WORLD, M, rank, seed=11, dtype=torch.float64)
    runtime = PipelineRuntime(schedule, modules, loss_fn, config=RuntimeConfig(recv_lookahead=depth))
    batches = [make_batch(2 * M, 20 + i) for i in range(3)]
    results = [runtime.step(*_inputs(schedule, rank, b)) for b in batches]
    ref_losses, ref_grads, _ = reference(parts, batches)
    evaluated = runtime.evaluate(*_inputs(schedule, rank, batches[2]))
    return {"loss_err": max(abs(r.loss - w) / w for r, w in zip(results, ref_losses, strict=True)),
            "grad_err": _grad_errors(schedule, modules, ref_grads),
            "eval_loss_err": abs(evaluated.loss - ref_losses[2]) / ref_losses[2],
            "hoisted": depth in runtime._hoisted}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {f"{name}/{depth}": _lookahead_case(name, depth) for name in NAMES for depth in (1, -1)}


@pytest.mark.parametrize("depth", [1, -1])
@pytest.mark.parametrize("name", NAMES)
def test_steps_with_receives_posted_ahead_match_reference(results: Any, name: str, depth: int) -> None:
    for rank, rec in enumerate(r[f"{name}/{depth}"] for r in results):
        assert rec["hoisted"], rank
        assert rec["loss_err"] <= TIGHT, (rank, rec["loss_err"])
        assert rec["grad_err"] <= TIGHT, (rank, rec["grad_err"])
        assert rec["eval_loss_err"] <= TIGHT, (rank, rec["eval_loss_err"])


def test_forward_only_keeps_forwards_in_order_and_splits_pairs() -> None:
    schedule = lower(build("dualpipe", 2, 4))
    for row in schedule.actions:
        got = forward_only(row)
        assert all(a.op in (Op.F, Op.RECV_F, Op.SEND_F) for a in got)
        want = [p for a in row for p in a.compute_parts() if p.op is Op.F]
        assert [a for a in got if a.op is Op.F] == want
    assert any(a.op is Op.OVERLAP_F_B for row in schedule.actions for a in row)
