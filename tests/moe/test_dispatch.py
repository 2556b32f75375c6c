"""Expert parallelism on 2 gloo ranks: the sharded layer equals the whole layer run on each rank's tokens
(outputs, input gradients, expert gradients summed over the ranks that routed to them), with uneven routing,
experts or a whole rank that get no token, and a rank with no tokens at all."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.moe import ExpertGroup, MoELayer
from duplexpipe.moe.dispatch import expert_major
from duplexpipe.runtime.comm_points import CommRecord, CommSlot, Driver, forward_slot

WORLD = 2
CASES = {
    "uneven": ((), (7, 5)),
    "rank 1's experts get no token": ((0.0, 0.0, -1e3, -1e3), (6, 6)),
    "rank 1 has no tokens": ((), (9, 0)),
}


def _case(rank: int, bias: tuple[float, ...], rows: tuple[int, ...]) -> dict[str, Any]:
    torch.manual_seed(0)
    whole = MoELayer(6, 10, 4, 2, shared_experts=1).double()
    if bias:
        whole.router.expert_bias.copy_(torch.tensor(bias))
    layer = copy.deepcopy(whole)
    layer.shard_experts(ExpertGroup(None, rank, WORLD))
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(rows[rank], 6, dtype=torch.float64, generator=gen)
    grad = torch.randn(rows[rank], 6, dtype=torch.float64, generator=gen)
    log: list[CommRecord] = []
    xs, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    with forward_slot(CommSlot(Driver(log=log))):
        y = layer(xs)
    y.backward(grad)
    want = whole(xw)
    want.backward(grad)
    worst = float((y - want).abs().max()) if y.numel() else 0.0
    worst = max(worst, float((xs.grad - xw.grad).abs().max()) if x.numel() else 0.0)
    for e in range(4):  # expert e's gradient: the sum of every rank's contribution, on its owner
        for name, p in whole.experts[str(e)].named_parameters():
            total = p.grad.clone()
            dist.all_reduce(total)
            if str(e) in layer.experts:
                got = dict(layer.experts[str(e)].named_parameters())[name].grad
                worst = max(worst, float((got - total).abs().max()))
    for name, p in whole.router.named_parameters():
        worst = max(worst, float((dict(layer.router.named_parameters())[name].grad - p.grad).abs().max()))
    received = [int(v) for v in layer.load.tolist()]
    return {"worst": worst, "labels": [r.label for r in log], "load": received}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {name: _case(rank, bias, rows) for name, (bias, rows) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_layer_equals_the_whole_layer(results: list[dict[str, Any]], name: str) -> None:
    for rank in range(WORLD):
        assert results[rank][name]["worst"] < 1e-12, (rank, results[rank][name])


def test_every_rank_issues_the_same_exchanges_in_the_same_order(results: list[dict[str, Any]]) -> None:
    for name in CASES:
        assert results[0][name]["labels"] == results[1][name]["labels"]
    assert results[0]["uneven"]["labels"] == ["moe counts", "moe dispatch", "moe combine",
                                              "moe combine backward", "moe dispatch backward"]


def test_steered_routing_leaves_rank_1s_experts_empty(results: list[dict[str, Any]]) -> None:
    loads = [results[r]["rank 1's experts get no token"]["load"] for r in range(WORLD)]
    assert all(load[2] == load[3] == 0 for load in loads) and all(sum(load) == 12 for load in loads)


def test_expert_major_order() -> None:
    assert expert_major([[2]]) is None
    # from source 0: 1 row for expert 0, 2 for expert 1; from source 1: 2 rows for expert 0, 0 for expert 1
    assert expert_major([[1, 2], [2, 0]]).tolist() == [0, 3, 4, 1, 2]
    assert expert_major([[0, 0], [0, 0]]).tolist() == []
