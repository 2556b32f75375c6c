"""Tests for duplexpipe.train.checkpoint: resumed training repeats the uninterrupted run exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _train_helpers import WIDTH, adam, batch, make_parts, mse
from torch import nn

from duplexpipe.launch.processes import launch
from duplexpipe.launch.train_config import lr_factor
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.train.trainer import Pipeline, PipelineConfig

TOTAL, SAVE_AT = 8, 5


def _warmup_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor("cosine", 3, TOTAL, 0.1))


def _build(schedule: str, microbatches: int, seed: int, dp: int = 1, blocks: int = 8,
           scheduler: bool = False) -> Pipeline:
    pp = dist.get_world_size() // dp
    cfg = PipelineConfig(schedule, microbatches, grad_clip_norm=0.2)
    num_parts = blocks if schedule == "dualpipev" else pp
    mesh = make_mesh(pp, dp) if dp > 1 else None
    return Pipeline(make_parts(num_parts, blocks, seed), mse, adam, cfg, mesh=mesh,
                    scheduler=_warmup_cosine if scheduler else None)


def _local(pipe: Pipeline, step: int) -> tuple[Any, Any]:
    x, y = batch(step)
    half = 16 // pipe.groups.dp_size
    lo = pipe.groups.dp_rank * half
    return x[lo:lo + half], y[lo:lo + half]


def _resume_case(root: str, name: str, schedule: str, microbatches: int, save_at: int,
                 dp: int = 1, scheduler: bool = False) -> dict[str, Any]:
    path = str(Path(root) / name)
    first = _build(schedule, microbatches, seed=0, dp=dp, scheduler=scheduler)
    straight, lrs = [], []
    for step in range(TOTAL):
        if step == save_at:
            first.save(path)
        straight.append(first.step(*_local(first, step)))
        lrs.append(first.optimizer.param_groups[0]["lr"])
    resumed = _build(schedule, microbatches, seed=1, dp=dp, scheduler=scheduler)  # different weights until loaded
    resumed.load(path)
    tail, tail_lrs = [], []
    for step in range(save_at, TOTAL):
        tail.append(resumed.step(*_local(resumed, step)))
        tail_lrs.append(resumed.optimizer.param_groups[0]["lr"])
    return {"straight": straight[save_at:], "resumed": tail, "calls": resumed.calls,
            "lrs": lrs[save_at:], "resumed_lrs": tail_lrs}


def _wrong_layout(root: str) -> str:
    pipe = _build("1f1b", 4, seed=0)
    try:
        pipe.load(str(Path(root) / "dualpipev"))
    except ValueError as exc:
        return str(exc)
    return ""


def _scheduler_mismatch(root: str) -> str:
    pipe = _build("dualpipe", 8, seed=0)  # no scheduler; "scheduler" was saved with one
    try:
        pipe.load(str(Path(root) / "scheduler"))
    except ValueError as exc:
        return str(exc)
    return ""


def _all_cases(root: str) -> dict[str, Any]:
    return {
        "dualpipe": _resume_case(root, "dualpipe", "dualpipe", 8, SAVE_AT),
        "dualpipev": _resume_case(root, "dualpipev", "dualpipev", 8, SAVE_AT),
        "fresh": _resume_case(root, "fresh", "1f1b", 4, 0),
        "pp2xdp2": _resume_case(root, "pp2xdp2", "1f1b", 4, SAVE_AT, dp=2),
        "wrong": _wrong_layout(root),
        "scheduler": _resume_case(root, "scheduler", "dualpipe", 8, SAVE_AT, scheduler=True),
        "no_scheduler": _scheduler_mismatch(root),
    }


def _dropout_pipe() -> Pipeline:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.3)) for _ in range(4)]
    return Pipeline(blocks, mse, adam, PipelineConfig("dualpipe", 8))


def _dropout_straight(root: str) -> list[float]:
    """Dropout model: the uninterrupted run, saving at SAVE_AT."""
    pipe = _dropout_pipe()
    torch.manual_seed(100 + dist.get_rank())  # each rank its own dropout stream
    losses = []
    for step in range(TOTAL):
        if step == SAVE_AT:
            pipe.save(str(Path(root) / "dropout"))
        losses.append(pipe.step(*batch(step)))
    return losses[SAVE_AT:]


def _dropout_resumed(root: str) -> list[float]:
    """Fresh processes, a different RNG state until the checkpoint's is loaded."""
    pipe = _dropout_pipe()
    torch.manual_seed(999)
    pipe.load(str(Path(root) / "dropout"))
    return [pipe.step(*batch(step)) for step in range(SAVE_AT, TOTAL)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = launch(_all_cases, 4, (root,), timeout_s=240)
    straight = launch(_dropout_straight, 4, (root,), timeout_s=120)
    resumed = launch(_dropout_resumed, 4, (root,), timeout_s=120)
    for rank, rec in enumerate(out):
        rec["dropout"] = {"straight": straight[rank], "resumed": resumed[rank]}
    return out


@pytest.mark.timeout(560)
def test_dropout_model_resumes_exactly_in_fresh_processes(results: list[dict[str, Any]]) -> None:
    """The RNG state of every rank is in the checkpoint: dropout masks after resuming are the same."""
    for rank, rec in enumerate(results):
        got = rec["dropout"]
        assert len(got["resumed"]) == TOTAL - SAVE_AT
        assert got["resumed"] == got["straight"], (rank, got)


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", ["dualpipe", "dualpipev", "fresh", "pp2xdp2", "scheduler"])
def test_resume_continues_with_exactly_the_same_losses(results: list[dict[str, Any]], case: str) -> None:
    for res in results:
        got = res[case]
        assert got["resumed"] == got["straight"], got
        assert got["resumed_lrs"] == got["lrs"], got
        assert got["calls"] == TOTAL
    assert len(results[0][case]["resumed"]) == TOTAL - (0 if case == "fresh" else SAVE_AT)


@pytest.mark.timeout(560)
def test_loading_another_layout_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    messages = [res["wrong"] for res in results]
    assert all(messages), messages
    assert "lacks" in messages[0] and "model.stage0.layer1" in messages[0]


@pytest.mark.timeout(560)
def test_lr_schedule_resumes_mid_decay_and_a_missing_scheduler_is_an_error(results: list[dict[str, Any]]) -> None:
    lrs = results[0]["scheduler"]["lrs"]  # after steps SAVE_AT.. of warm-up 3 + cosine: decaying to 0.1 x lr
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < 1e-2 and lrs[-1] == pytest.approx(1e-3)
    for res in results:
        assert "the checkpoint has an LR scheduler but this Pipeline has none" in res["no_scheduler"]
