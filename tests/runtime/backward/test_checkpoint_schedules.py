"""Activation checkpointing in pipelines on 4 gloo ranks (8 residual MLP blocks, M=8, float64, 2 SGD steps) against
one process: under every schedule with a split backward (and 1F1B), full, selective and every-k-th-block
checkpointing are exact, and a checkpointed block's forward runs at most twice per microbatch (the forward and one
recompute, however many W engine calls the split backward makes)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _counting import CountMatmuls
from models import run_workers
from torch import nn

from duplexpipe import Pipeline, PipelineConfig

WORLD, BLOCKS, M, ROWS, DIM = 4, 8, 8, 16, 8
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zbv", "dualpipe", "dualpipev")
MODES: dict[str, Any] = {"full": "full", "selective": "selective", "every 2": {"every": 2}, "none": False}
SPAWN_TIMEOUT_S = 400


class Counted(nn.Module):
    """A residual MLP block (three param groups: W runs three engine calls) counting its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64))


def _case(schedule: str, option: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    layers = [Counted().double() for _ in range(BLOCKS)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    optimizer = _sgd(list(reference.parameters()))
    pipe = Pipeline.from_layers(layers, _mse, _sgd, PipelineConfig(schedule, M, activation_checkpointing=option))
    losses, want = [], []
    calls: dict[int, int] = {}
    matmuls = 0
    for step in range(2):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = _mse(reference(x), y)
        loss.backward()
        optimizer.step()
        want.append(loss.item())
        if step == 0:
            losses.append(pipe.step(x, y))
            continue
        for module in pipe.stage_modules.values():
            for block in module.modules():
                if isinstance(block, Counted):
                    block.calls = 0
        with CountMatmuls() as counter:
            losses.append(pipe.step(x, y))
        matmuls = counter.count
        for module in pipe.stage_modules.values():
            for name, block in module.named_modules():
                if isinstance(block, Counted):
                    calls[int(name.split(".")[-1].removeprefix("layer"))] = block.calls
    worst = 0.0
    for module in pipe.stage_modules.values():
        for name, param in module.named_parameters():
            index, rest = name.removeprefix("module.").split(".", 1)
            ref = reference[int(index.removeprefix("layer"))].get_parameter(rest)
            worst = max(worst, (param.detach() - ref.detach()).abs().max().item())
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)), "param_err": worst,
            "calls": calls, "matmuls": matmuls}


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {(schedule, mode): _case(schedule, option) for schedule in SCHEDULES for mode, option in MODES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[str, str], Any]]:
    return run_workers(_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", list(MODES))
def test_checkpointing_is_exact(results: list[dict[tuple[str, str], Any]], schedule: str, mode: str) -> None:
    for rank in results:
        case = rank[(schedule, mode)]
        assert case["loss_err"] < 1e-12 and case["param_err"] < 1e-12, (schedule, mode, case)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_checkpointed_block_runs_at_most_twice_per_microbatch(results: list[dict[tuple[str, str], Any]],
                                                                schedule: str) -> None:
    """Summed over the ranks (DualPipe's two copies of a part each run half the microbatches)."""
    for mode in ("full", "selective", "every 2"):
        runs = [0] * BLOCKS
        for rank in results:
            for index, calls in rank[(schedule, mode)]["calls"].items():
                runs[index] += calls
        checkpointed = [i for i in range(BLOCKS) if mode != "every 2" or i % 2 == 1]
        assert all(runs[i] <= 2 * M for i in checkpointed), (mode, runs)
        assert all(runs[i] == M for i in range(BLOCKS) if i not in checkpointed), (mode, runs)
        plain = [0] * BLOCKS
        for rank in results:
            for index, calls in rank[(schedule, "none")]["calls"].items():
                plain[index] += calls
        assert plain == [M] * BLOCKS


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_selective_recomputes_fewer_matmuls_than_full(results: list[dict[tuple[str, str], Any]],
                                                      schedule: str) -> None:
    matmuls = {mode: sum(rank[(schedule, mode)]["matmuls"] for rank in results) for mode in MODES}
    assert matmuls["none"] <= matmuls["selective"] < matmuls["full"], matmuls
