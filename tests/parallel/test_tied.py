"""Tests for duplexpipe.parallel.tied: finding weights shared by parts and planning their gradient sum.

The multi-process sums are exercised end to end by tests/model/test_hf.py (GPT-2's tied embedding trained
with 1F1B, ZBV, DualPipe and pipeline x data parallelism against a single-process reference).
"""

from __future__ import annotations

import copy

from torch import nn

from duplexpipe.parallel.tied import TiedGrads, TiedParam, find_tied, plan_tie
from duplexpipe.schedules.registry import build


def _tied_parts(num_parts: int) -> list[nn.Module]:
    """Embedding in the first part, a head sharing its weight in the last, a Linear in between."""
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    parts: list[nn.Module] = [nn.Sequential(nn.Linear(4, 4)) for _ in range(num_parts)]
    parts[0] = nn.Sequential(embed, nn.Linear(4, 4))
    parts[-1] = nn.Sequential(nn.Linear(4, 4), head)
    return parts


def test_find_tied_reports_parameters_shared_across_parts() -> None:
    parts = _tied_parts(4)
    assert find_tied(parts) == [TiedParam(((0, "0.weight"), (3, "1.weight")))]
    assert find_tied(parts)[0].parts == (0, 3)
    same_part = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    same_part[1].weight = same_part[0].weight  # inside one part: a deep copy keeps it shared
    assert find_tied([same_part, nn.Linear(2, 2)]) == []
    frozen = _tied_parts(2)
    frozen[0][0].weight.requires_grad_(False)
    assert find_tied(frozen) == []
    assert find_tied([nn.Linear(2, 2), nn.Linear(2, 2)]) == []


def test_plan_sums_across_ranks_when_no_rank_holds_every_part() -> None:
    tie = TiedParam(((0, "emb"), (3, "head")))
    schedule = build("1f1b", 4, 4)
    plans = [plan_tie(tie, schedule, r) for r in range(4)]
    assert [p.copies for p in plans] == [((0, "emb"),), (), (), ((3, "head"),)]
    assert [p.contributions for p in plans] == [((0, "emb"),), (), (), ((3, "head"),)]
    assert plans[0].holders == plans[3].holders == (0, 3)
    interleaved = build("interleaved-1f1b", 2, 4)  # parts 0..3; part 3 is stage 3 on rank 1
    tie8 = TiedParam(((0, "emb"), (3, "head")))
    assert [plan_tie(tie8, interleaved, r).holders for r in range(2)] == [(0, 1), (0, 1)]


def test_plan_sums_locally_where_every_holder_has_both_parts() -> None:
    tie = TiedParam(((0, "emb"), (7, "head")))
    zbv = build("zbv", 4, 4)  # V shape: stages 0 and 7 both on rank 0
    plan = plan_tie(tie, zbv, 0)
    assert plan.copies == ((0, "emb"), (7, "head")) and plan.holders == ()
    assert plan.contributions == ((0, "emb"), (7, "head"))
    assert plan_tie(tie, zbv, 1).copies == ()
    dualpipe = build("dualpipe", 4, 8)  # rank 0: stage 0 (part 0) and stage 7 (part 3, mirror copy)
    tie4 = TiedParam(((0, "emb"), (3, "head")))
    for rank, stages in ((0, (0, 7)), (3, (3, 4))):
        plan = plan_tie(tie4, dualpipe, rank)
        assert plan.holders == () and tuple(s for s, _ in plan.copies) == stages
        assert sorted(dualpipe.stages[s].group for s, _ in plan.contributions) == [0, 3]  # each part once
    assert plan_tie(tie4, dualpipe, 1).copies == ()


def test_local_sum_and_norm_counting_on_one_rank() -> None:
    """ZBV, rank 0 of 2: both copies (parts 0 and 3) on the rank; the sum needs no process group."""
    parts = _tied_parts(4)
    schedule = build("zbv", 2, 2)
    modules = {s: copy.deepcopy(parts[schedule.stages[s].group]) for s in schedule.stages_of_rank(0)}
    assert sorted(modules) == [0, 3]
    tied = TiedGrads(find_tied(parts), schedule, 0, modules)
    emb, head = modules[0][0].weight, modules[3][1].weight
    assert emb is not head
    emb.grad = emb.detach().clone().fill_(1.0)
    head.grad = None  # a copy without a gradient counts as zero
    tied.sum_grads()
    assert emb.grad is not None and head.grad is not None
    assert emb.grad.eq(1.0).all() and head.grad.eq(1.0).all() and emb.grad is not head.grad
    head.grad.fill_(2.0)
    tied.sum_grads()
    assert emb.grad.eq(3.0).all() and head.grad.eq(3.0).all()
    params = [p for s in sorted(modules) for p in modules[s].parameters()]
    counted = {id(p) for p in tied.counted(params)}
    assert id(head) not in counted and id(emb) in counted
    assert len(tied.counted(params)) == len(params) - 1

