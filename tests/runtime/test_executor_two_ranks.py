"""PipelineRuntime failure paths on 2 ranks: NCCL's pair-order check up front, and a batch that breaks the
shape agreement kept by check_inputs_every_step=False."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _executor_cases import _attempt
from models import loss_fn, make_batch, make_parts, run_workers, stage_modules

from duplexpipe.errors import PipelineError
from duplexpipe.runtime import PipelineRuntime, RuntimeConfig
from duplexpipe.runtime.transport import MailTransport
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

CROSSING = ("0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1")
"""A lowered 2-rank 1F1B that runs on gloo but whose two directions cross (would hang on NCCL)."""


def _nccl_order(rank: int) -> dict[str, str]:
    from duplexpipe.errors import ScheduleError
    from duplexpipe.schedules.ir import StageInfo, parse_action

    crossing = Schedule("crossing", 2, 2, (StageInfo(0, 0), StageInfo(1, 1)),
                        tuple(tuple(parse_action(t) for t in row.split()) for row in CROSSING))
    parts = make_parts(2)
    outcome: dict[str, str] = {}
    # gloo underneath, NCCL's rules on top; without NCCL's connection probes (gloo sees a send complete only once
    # it was waited for, so a probe polled for completion would never end)
    real_get_backend, real_connect = dist.get_backend, MailTransport.connect
    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    MailTransport.connect = lambda self, pairs: None  # type: ignore[method-assign]
    try:
        for label, schedule in (("crossing", crossing), ("ours", lower(build("1f1b", 2, 2)))):
            try:
                PipelineRuntime(schedule, stage_modules(schedule, rank, parts), loss_fn,
                                device=torch.device("cpu"), config=RuntimeConfig(timeout_s=20))
                outcome[label] = "built"
            except (ScheduleError, ValueError) as exc:
                outcome[label] = str(exc)
    finally:
        dist.get_backend = real_get_backend  # type: ignore[assignment]
        MailTransport.connect = real_connect  # type: ignore[method-assign]
    return outcome


def _kept_mismatch(rank: int, bad_rank: int) -> dict[str, Any]:
    """1F1B P=2, check_inputs_every_step=False: after two steps, rank `bad_rank` gets one more row
    (rank 0 holds the inputs, rank 1 the targets)."""
    group = dist.new_group([0, 1])  # a fresh group: the failed step leaves receives posted on it
    schedule = lower(build("1f1b", 2, 4))
    runtime = PipelineRuntime(schedule, stage_modules(schedule, rank, make_parts(2)), loss_fn, group=group,
                              config=RuntimeConfig(check_inputs_every_step=False, timeout_s=60.0))
    tokens, targets = make_batch(9, 30)
    bigger = make_batch(10, 31)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        runtime.step(x if rank == 0 else None, y if rank == 1 else None)

    step(tokens, targets)
    step(tokens, targets)
    out = _attempt(lambda: step(bigger[0], targets) if bad_rank == 0 else step(tokens, bigger[1]))
    try:
        step(tokens, targets)
        out["after"] = "ran"
    except PipelineError as exc:
        out["after"] = str(exc)
    return out


def _two_rank_worker(rank: int, world: int) -> dict[str, Any]:
    return {"nccl": _nccl_order(rank), "bad_inputs": _kept_mismatch(rank, 0), "bad_targets": _kept_mismatch(rank, 1)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_workers(_two_rank_worker, 2, timeout_s=90)


@pytest.mark.timeout(120)
def test_on_nccl_a_crossing_schedule_is_rejected_up_front_on_every_rank(two_ranks: Any) -> None:
    for rank, rec in enumerate(two_ranks):
        outcome = rec["nccl"]
        assert "ranks 0 and 1 disagree on the order of their messages" in outcome["crossing"], (rank, outcome)
        assert outcome["ours"] == "built", (rank, outcome)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, bad_rank, needle", [
    ("bad_inputs", 0, "rank 0: expected inputs of shape (9, 3) and dtype torch.int64, got shape (10, 3)"),
    ("bad_targets", 1, "rank 1: expected targets with 9 rows, got 10"),
])
def test_kept_agreement_mismatch_fails_every_rank_promptly(two_ranks: Any, case: str, bad_rank: int,
                                                            needle: str) -> None:
    bad, other = two_ranks[bad_rank][case], two_ranks[1 - bad_rank][case]
    assert bad["type"] == "ValueError" and needle in bad["text"], bad
    assert "check_inputs_every_step=False" in bad["text"]
    assert other["type"] == "PeerFailedError" and other["failed_rank"] == bad_rank, other
    assert needle in other["text"] and other["seconds"] < 30.0, other
    for rec in (bad, other):
        assert "this PipelineRuntime stopped after an error" in rec["after"], rec
