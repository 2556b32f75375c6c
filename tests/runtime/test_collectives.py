"""Step-level group communication on 2 gloo ranks: agreement, loss sum, mirrored grads, outputs."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.runtime.collectives import (
    Agreement,
    BatchAgreement,
    MirrorSum,
    PendingSum,
    SharedSum,
    agree,
    share_blocks,
    sum_over_group,
)
from duplexpipe.runtime.handshake import group_store
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

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
    stash = mirror.set_aside()
    cleared = all(p.grad is None for m in modules.values() for p in m.parameters())
    for stage, module in modules.items():
        module.weight.grad = torch.full_like(module.weight, float(10 * stage + 1))
        # the bias gets a gradient on rank 0 only (None counts as zero on the other side)
        if rank == 0:
            module.bias.grad = torch.full_like(module.bias, float(stage + 1))
    mirror.sum(stash)
    return {"cleared": cleared, "pairs": mirror.pairs,
            "grads": {s: (m.weight.grad[0, 0].item(), m.bias.grad[0].item()) for s, m in modules.items()}}


class JoinClock:
    """A logical clock shared by the ranks through the store: how many ranks have joined the sum so far. It stands
    in for the wall clock, so the test says what happened before what, whatever the machine's speed."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key

    def tick(self) -> None:
        """This rank joins."""
        self.store.add(self.key, 1)

    def __call__(self) -> int:
        return int(self.store.add(self.key, 0))


def _pending(rank: int, dog: Watchdog) -> dict[str, Any]:
    """Rank 1 joins the sum only once rank 0's posting returned: were posting to wait for every rank, neither
    would go on (rank 1 would time out waiting for the word). value() returns once rank 1 joined."""
    store = group_store(None)
    clock = JoinClock(store, "pending/joined")
    dist.barrier()
    if rank == 1:
        store.wait(["pending/posted"], timedelta(seconds=20))
    clock.tick()
    pending = PendingSum(torch.tensor(0.25 * (rank + 1), dtype=torch.float64), None, CPU, dog, "a late sum")
    posted_at = clock()
    if rank == 0:
        store.set("pending/posted", "1")
    value = pending.value()
    return {"pending": (value, pending.value()), "posted_at": posted_at, "waited_at": clock()}


def _shared(rank: int, dog: Watchdog) -> dict[str, Any]:
    """SharedSum: one source (rank 1, sharing late) and two sources; the same float on both ranks."""
    one = SharedSum((1,), None, CPU, dog, "a shared sum")
    if rank == 1:
        time.sleep(0.3)
        one.share(torch.tensor(2.5, dtype=torch.float64))
    two = SharedSum((0, 1), None, CPU, dog, "a shared sum")
    two.share(torch.tensor([0.1, 0.2][rank], dtype=torch.float64))
    return {"shared_one": one.value(), "shared_two": (two.value(), two.value())}


def _worker(rank: int, world: int) -> dict[str, Any]:
    dist.barrier()
    dog = Watchdog(group_store(None), "collectives", rank, timeout_s=20.0, poll_s=0.05, gloo=True)
    out = _agreements(rank, dog)
    out["sum"] = sum_over_group(1.5 + rank, None, CPU, dog, "a test sum")
    out.update(_pending(rank, dog))
    out.update(_shared(rank, dog))
    out.update(_mirror(rank, dog))
    block = torch.arange(6.0).reshape(2, 3) if rank == 0 else torch.arange(12).reshape(4, 3)
    got = share_blocks(block, [1 - rank], [0, 1], None, CPU, dog)[1 - rank]
    out["shared"] = (str(got.dtype), got.tolist())  # plain data: tensors do not outlive the worker
    return out


def test_agreement_tells_every_rank_the_batch_and_targets(results: Any) -> None:
    for rec in results:
        got = rec["normal"]
        assert (got.batch, got.signature, got.target_rows, got.error_rank) == (10, 77, 10, -1)
        assert got.consistent


def test_agreement_detects_different_batches_and_rejections(results: Any) -> None:
    for rec in results:
        assert not rec["differing"].consistent
        assert rec["rejected"].error_rank == 1
        assert rec["rejected"].target_rows == -1 and rec["rejected"].batch == -1


def test_sum_over_group(results: Any) -> None:
    assert [rec["sum"] for rec in results] == [4.0, 4.0]


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


def test_share_blocks_exchanges_tensors_of_any_shape_and_dtype(results: Any) -> None:
    assert results[1]["shared"] == ("torch.float32", torch.arange(6.0).reshape(2, 3).tolist())
    assert results[0]["shared"] == ("torch.int64", torch.arange(12).reshape(4, 3).tolist())


def test_shared_sum_adds_the_sources_values_identically_on_every_rank(results: Any) -> None:
    assert [rec["shared_one"] for rec in results] == [2.5, 2.5]
    assert [rec["shared_two"] for rec in results] == [(0.1 + 0.2, 0.1 + 0.2)] * 2


def test_pending_sum_is_posted_without_waiting_and_equal_on_every_rank(results: Any) -> None:
    assert [rec["pending"] for rec in results] == [(0.75, 0.75), (0.75, 0.75)]
    assert results[0]["posted_at"] == 1  # posting returned before rank 1 joined (it waited for the word)
    assert results[0]["waited_at"] == 2  # value() returned after rank 1 joined


def _agreement(batch: int, target_rows: int, error_rank: int = -1, consistent: bool = True) -> Agreement:
    return Agreement(batch, 123, target_rows, error_rank, consistent)


@pytest.mark.parametrize("found, error, train, needle", [
    (_agreement(8, 8), "rank 0: inputs are bad", True, "rank 0: inputs are bad"),
    (_agreement(8, 8, error_rank=2), "", True, "rank 2 rejected its step inputs"),
    (_agreement(8, 8, consistent=False), "", True, "batches (or targets) of different sizes"),
    (_agreement(8, 9), "", False, "targets have 9 rows but inputs have 8"),
    (_agreement(8, -1), "", True, "step() needs targets on the ranks holding last stages"),
])
def test_accept_rejects_bad_agreements(found: Agreement, error: str, train: bool, needle: str) -> None:
    batches = BatchAgreement(False, 0, True)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        batches.accept(found, error, train, torch.zeros(8, 3))
    assert batches.reuse(torch.zeros(8, 3), torch.zeros(8), "") is None  # nothing kept after a failure


def test_every_step_keeps_nothing_and_evaluate_forgets_the_kept_batch() -> None:
    every = BatchAgreement(True, 0, True)
    every.accept(_agreement(8, 8), "", True, torch.zeros(8, 3))
    assert every.reuse(torch.zeros(8, 3), torch.zeros(8), "") is None
    kept = BatchAgreement(False, 0, True)
    kept.accept(_agreement(8, 8), "", True, torch.zeros(8, 3))
    assert kept.reuse(torch.zeros(8, 3), torch.zeros(8), "") == _agreement(8, 8)
    kept.accept(_agreement(4, -1), "", False, torch.zeros(4, 3))  # an evaluate() without targets
    assert kept.reuse(torch.zeros(8, 3), torch.zeros(8), "") is None


def test_reuse_names_expected_and_got() -> None:
    first = BatchAgreement(False, 0, False)  # holds a first stage only
    first.accept(_agreement(8, 8), "", True, torch.zeros(8, 3, dtype=torch.int64))
    assert first.reuse(torch.ones(8, 3, dtype=torch.int64), None, "") == _agreement(8, 8)
    with pytest.raises(ValueError, match=r"rank 0: expected inputs of shape \(8, 3\) and dtype torch.int64, "
                                         r"got shape \(8, 4\) and dtype torch.int64 \(with RuntimeConfig"):
        first.reuse(torch.zeros(8, 4, dtype=torch.int64), None, "")
    with pytest.raises(ValueError, match="expected inputs of shape .* got shape \\(8, 3\\) and dtype torch.int32"):
        first.reuse(torch.zeros(8, 3, dtype=torch.int32), None, "")
    last = BatchAgreement(False, 1, True)  # holds a last stage only
    last.accept(_agreement(8, 8), "", True, None)
    with pytest.raises(ValueError, match="rank 1: expected targets with 8 rows, got 9"):
        last.reuse(None, torch.zeros(9), "")
    with pytest.raises(ValueError, match="rank 1: targets are required"):
        last.reuse(None, None, "rank 1: targets are required")
