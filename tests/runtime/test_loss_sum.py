"""LossSum on 2 gloo ranks: where each rank posts its share (gloo: after its last loss, or when created if it
computes none; NCCL: after the list), shared sums and all-reduces, each posted once, the mean equal everywhere."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.errors import PipelineError
from duplexpipe.runtime.collectives import sum_over_group
from duplexpipe.runtime.handshake import group_store
from duplexpipe.runtime.loss_sum import LossSum
from duplexpipe.runtime.watchdog import Watchdog

CPU = torch.device("cpu")
LOSSES = ((2.0, 0.25), (4.0, 0.75))
"""Rank 1's (loss, weight) pairs: 0.5 + 3.0 = 3.5."""


def _sum(rank: int, dog: Watchdog, *, gloo: bool, shared: bool, divisor: int = 1) -> dict[str, Any]:
    """Rank 1 computes the losses (its last one at position 3), rank 0 none."""
    loss = LossSum(3 if rank == 1 else None, gloo=gloo, sources=(1,) if shared else None, group=None, device=CPU,
                   watchdog=dog, divisor=divisor)
    out: dict[str, Any] = {"post_after": loss.post_after}
    if not shared:  # an all-reduce not posted yet cannot be read (a shared sum's value would wait for its sources)
        try:
            loss.value()
            out["read_early"] = "no error"
        except PipelineError as exc:
            out["read_early"] = str(exc)
    if rank == 1:
        for value, weight in LOSSES:
            loss.add(torch.tensor(value, dtype=torch.float64), weight)
        if loss.post_after is not None:
            loss.post()  # where the runtime posts it: after the action at post_after
    loss.post()  # after the list (NCCL's post)
    loss.post()  # posting twice sends once: the next sum below would be off otherwise
    out["value"] = (loss.value(), loss.value())
    out["after"] = sum_over_group(1.0 + rank, None, CPU, dog, "the next sum")
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    dist.barrier()
    dog = Watchdog(group_store(None), "loss-sum", rank, timeout_s=20.0, poll_s=0.05, gloo=True)
    return {"shared": _sum(rank, dog, gloo=True, shared=True),
            "reduced": _sum(rank, dog, gloo=True, shared=False, divisor=2),
            "nccl": _sum(rank, dog, gloo=False, shared=False)}


def test_a_shared_sum_is_posted_by_its_source_after_its_last_loss(results: Any) -> None:
    assert [r["shared"]["post_after"] for r in results] == [None, 3]
    assert [r["shared"]["value"] for r in results] == [(3.5, 3.5)] * 2


def test_an_all_reduce_is_posted_at_the_start_by_a_rank_without_losses(results: Any) -> None:
    reduced = [r["reduced"] for r in results]
    assert [r["post_after"] for r in reduced] == [None, 3]
    assert [r["value"] for r in reduced] == [(1.75, 1.75)] * 2  # the sum over the ranks / 2 pipelines
    assert reduced[0]["read_early"] == "no error"  # rank 0 posted when created: its read waited for rank 1
    assert "the loss sum was read before this rank posted its share" in reduced[1]["read_early"]


def test_on_nccl_every_rank_posts_after_the_list(results: Any) -> None:
    nccl = [r["nccl"] for r in results]
    assert [r["post_after"] for r in nccl] == [None, None]
    assert all("the loss sum was read before this rank posted its share" in r["read_early"] for r in nccl)
    assert [r["value"] for r in nccl] == [(3.5, 3.5)] * 2


def test_each_share_is_posted_once(results: Any) -> None:
    for rec in results:
        assert [rec[case]["after"] for case in ("shared", "reduced", "nccl")] == [3.0] * 3
