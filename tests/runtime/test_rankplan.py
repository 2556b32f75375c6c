"""RankPlan: receives hoisted ahead of the list keep every guarantee the list had, and the steps that run
them still match the single-process reference (one spawn of 4 gloo ranks)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import networkx as nx
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


def test_1f1b_releases_each_send_when_the_reply_it_caused_is_taken() -> None:
    schedule = lower(build("1f1b", 2, 4))
    first, last = (RankPlan.of(schedule, rank).sends_done for rank in (0, 1))
    assert first == {(Op.B, 0, mb): ((Op.SEND_F, 0, mb),) for mb in range(4)}  # F mb's gradient came back
    # the last stage's gradients 0 and 1 are proven received by the inputs of microbatches 2 and 3; 2 and 3 by none
    assert last == {(Op.F, 1, 2): ((Op.SEND_B, 1, 0),), (Op.F, 1, 3): ((Op.SEND_B, 1, 1),)}


def _happens_before(schedule: Schedule) -> nx.DiGraph:
    """(rank, position) of every action; edges: each rank's order, and a send to the compute taking its message."""
    layout = Layout.of(schedule)
    graph = nx.DiGraph()
    takes: dict[tuple[Op, int, int], tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for pos, action in enumerate(actions):
            graph.add_node((rank, pos))
            if pos:
                graph.add_edge((rank, pos - 1), (rank, pos))
            for part in action.compute_parts():
                takes.setdefault((part.op, part.stage, part.microbatch), (rank, pos))
    for rank, actions in enumerate(schedule.actions):
        for pos, a in enumerate(actions):
            if a.op is Op.SEND_F:
                graph.add_edge((rank, pos), takes[(Op.F, layout.nxt[a.stage], a.microbatch)])
            elif a.op is Op.SEND_B:
                found = [takes[k] for k in ((Op.B, layout.prv[a.stage], a.microbatch),
                                            (Op.I, layout.prv[a.stage], a.microbatch)) if k in takes]
                graph.add_edge((rank, pos), min(found))
    return graph


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_a_send_is_released_only_after_its_receiver_took_it(name: str, P: int) -> None:
    """Checked on the happens-before graph: the compute that takes the send's message precedes the release."""
    schedule = lower(build(name, P, 2 * P))
    graph = _happens_before(schedule)
    released = 0
    for rank in range(P):
        plan = RankPlan.of(schedule, rank)
        at = {(a.op, a.stage, a.microbatch): pos for pos, a in enumerate(plan.actions)}
        for pos, keys in plan.sends_done_at().items():
            for op, stage, mb in keys:
                send = (rank, at[(op, stage, mb)])
                taker = next(n for n in graph.successors(send) if n[0] != rank)
                assert nx.has_path(graph, taker, (rank, pos)), (rank, pos, op, stage, mb)
                released += 1
        hoisted = plan.hoisted(1)  # receives moved: the same releases, after the same computes
        assert sorted(hoisted.sends_done_at().values()) == sorted(plan.sends_done_at().values())
    sends = sum(a.op in (Op.SEND_F, Op.SEND_B) for actions in schedule.actions for a in actions)
    assert released >= sends // 2, (released, sends)  # most are released before the step's end


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
