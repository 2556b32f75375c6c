"""PipelineRuntime on CUDA with NCCL against the single-process reference (skipped without GPUs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _executor_cases import _grad_errors, _inputs, _timeline_record
from models import loss_fn, make_batch, make_parts, nccl_ranks_fit, reference, run_workers, stage_modules

from duplexpipe.runtime import PipelineRuntime
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build, names

NAMES = names()
TIGHT = 1e-12
"""float64 pipeline vs float64 reference: only summation order differs."""
SPAWN_TIMEOUT_S = 240


def _cuda_worker(rank: int, world: int, names: tuple[str, ...]) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {}
    for name in names:
        schedule = lower(build(name, world, 2 * max(world, 2)))
        parts = make_parts(schedule.num_groups, seed=2, dtype=torch.float64)
        modules = {s: m.to(device) for s, m in stage_modules(schedule, rank, parts).items()}
        runtime = PipelineRuntime(schedule, modules, loss_fn, device=device)
        batch = make_batch(2 * schedule.num_microbatches + 1, 12)
        results = [runtime.step(*_inputs(schedule, rank, batch)) for _ in range(2)]
        losses, ref_grads, _ = reference(parts, [batch, batch])
        record = _timeline_record(schedule, rank, results[0], None)
        record.update(loss_err=abs(results[1].loss - losses[1]) / losses[1],
                      grad_err=_grad_errors(schedule, modules, ref_grads),
                      positive_spans=all(e.duration > 0 for e in results[0].timeline.events))
        out[name] = record
    return out


def _check_cuda(results: list[dict[str, Any]]) -> None:
    for rank, per_name in enumerate(results):
        for name, rec in per_name.items():
            assert rec["loss_err"] <= TIGHT and rec["grad_err"] <= TIGHT, (rank, name, rec)
            assert rec["every_action_once"] and rec["in_list_order"] and rec["positive_spans"], (rank, name)


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_single_rank_schedules_on_cuda() -> None:
    _check_cuda(run_workers(_cuda_worker, 1, (("gpipe", "1f1b", "zb-h1"),), backend="nccl"))


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_on_several_ranks_with_nccl(world: int) -> None:
    if not nccl_ranks_fit(world):
        pytest.skip(f"needs {world} CUDA GPUs (or one with DUPLEXPIPE_SHARE_GPU=1)")
    _check_cuda(run_workers(_cuda_worker, world, (tuple(NAMES),), SPAWN_TIMEOUT_S - 30, backend="nccl"))
