"""Step-level group communication on 2 gloo ranks: agreement, loss sum, mirrored grads, outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import run_workers
from torch import nn

from duplexpipe.runtime.collectives import MirrorSum, agree, share_blocks, sum_over_group
from duplexpipe.runtime.handshake import group_store
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

SPAWN_TIMEOUT_S = 120
CPU = torch.device("cpu")


def _agreements(rank: int, dog: Watchdog) -> dict[str, Any]:
    normal = agree(10 if rank == 0 else None, 77 if rank == 0 else None, 10 if rank == 1 else None,
                   False, None, CPU, dog)
    differing = agree(8 + rank, 5, None, False, None, CPU, dog)  # both "hold first stages"
    rejected = agree(None, None, -1 if rank == 1 else None, rank == 1, None, CPU, dog)
    return {"normal": normal, "differing": differing, "rejected": rejected}


def _mirror(rank: int, dog: Watchdog) -> dict[str, Any]:
    """DualPipe P=2: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (mirrors 0<->2, 3<->1)."""
    schedule = lower(build("dualpipe", 2, 4))
    modules: dict[int, nn.Module] = {s: nn.Linear(2, 2) for s in schedule.stages_of_rank(rank)}
    for module in modules.values():
        for p in module.parameters():
            p.grad = torch.full_like(p, 100.0)  # from an earlier step: must not be summed again
    mirror = MirrorSum(schedule, rank, modules, None, [0, 1], dog)
    mirror.begin()
    cleared = all(p.grad is None for m in modules.values() for p in m.parameters())
    for stage, module in modules.items():
        module.weight.grad = torch.full_like(module.weight, float(10 * stage + 1))
        # the bias gets a gradient on rank 0 only (None counts as zero on the other side)
        if rank == 0:
            module.bias.grad = torch.full_like(module.bias, float(stage + 1))
    mirror.finish()
    return {"cleared": cleared, "pairs": mirror.pairs,
            "grads": {s: (m.weight.grad[0, 0].item(), m.bias.grad[0].item()) for s, m in modules.items()}}


def _worker(rank: int, world: int) -> dict[str, Any]:
    dist.barrier()
    dog = Watchdog(group_store(None), "collectives", rank, timeout_s=20.0, poll_s=0.05, threaded_p2p=True)
    out = _agreements(rank, dog)
    out["sum"] = sum_over_group(1.5 + rank, None, CPU, dog, "a test sum")
    out.update(_mirror(rank, dog))
    block = torch.arange(6.0).reshape(2, 3) if rank == 0 else torch.arange(12).reshape(4, 3)
    got = share_blocks(block, [1 - rank], [0, 1], None, CPU, dog)[1 - rank]
    out["shared"] = (str(got.dtype), got.tolist())  # plain data: tensors do not outlive the worker
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_worker, 2, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_agreement_tells_every_rank_the_batch_and_targets(results: Any) -> None:
    for rec in results:
        got = rec["normal"]
        assert (got.batch, got.signature, got.target_rows, got.error_rank) == (10, 77, 10, -1)
        assert got.consistent


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_agreement_detects_different_batches_and_rejections(results: Any) -> None:
    for rec in results:
        assert not rec["differing"].consistent
        assert rec["rejected"].error_rank == 1
        assert rec["rejected"].target_rows == -1 and rec["rejected"].batch == -1


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_sum_over_group(results: Any) -> None:
    assert [rec["sum"] for rec in results] == [4.0, 4.0]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_mirrored_stages_sum_only_this_steps_gradients(results: Any) -> None:
    assert results[0]["pairs"] == [(0, 2, 1), (3, 1, 1)]
    assert results[1]["pairs"] == [(2, 0, 0), (1, 3, 0)]
    assert all(rec["cleared"] for rec in results)
    # weight: 100 (kept) + 10*s+1 + 10*mirror+1; bias: 100 + (rank 0's stage + 1)
    want = {0: (100 + 1 + 21, 100 + 1), 2: (100 + 1 + 21, 100 + 1),
            3: (100 + 31 + 11, 100 + 4), 1: (100 + 31 + 11, 100 + 4)}
    for rec in results:
        for stage, got in rec["grads"].items():
            assert got == want[stage], (stage, got)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_share_blocks_exchanges_tensors_of_any_shape_and_dtype(results: Any) -> None:
    assert results[1]["shared"] == ("torch.float32", torch.arange(6.0).reshape(2, 3).tolist())
    assert results[0]["shared"] == ("torch.int64", torch.arange(12).reshape(4, 3).tolist())
