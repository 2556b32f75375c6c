"""Tests for duplexpipe.launch.profiling: a task's model parts for `duplexpipe profile` (its layers split, or a
Hugging Face model's: tests/launch/tasks/test_hf_task.py); the calibrated profile: tests/cli/test_plan_cmds.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from duplexpipe.launch.profiling import ProfileRequest, profile_here, task_parts
from duplexpipe.launch.train_task import TrainTask


def _task(blocks: int = 4) -> TrainTask:
    layers = [nn.Linear(4, 4) for _ in range(blocks)]
    data = torch.randn(8, 4)
    return TrainTask(layers=layers, loss_fn=nn.functional.mse_loss, batch=lambda step, size: (data[:size], data[:size]),
                     head=nn.Linear(4, 4))


def test_a_tasks_layers_are_split_with_its_head_in_the_last_part() -> None:
    parts, init, loss = task_parts(_task(), 2, "uniform")
    assert len(parts) == 2 and init is None and loss is nn.functional.mse_loss
    assert sum(isinstance(m, nn.Linear) for m in parts[1].modules()) == 3  # two blocks and the head
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 model parts"):
        task_parts(_task(), 5, "uniform")
    with pytest.raises(ValueError, match="cannot split 0 layers"):
        task_parts(_task(0), 1, "uniform")


def test_profile_here_refuses_a_microbatch_the_task_cannot_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("duplexpipe.launch.profiling.build_task", lambda _: _task())
    with pytest.raises(ValueError, match=r"--microbatch 9: the task's batch\(0, 9\) gave only 8 samples"):
        profile_here(ProfileRequest("x:y", parts=2, microbatch=9))
    profile = profile_here(ProfileRequest("x:y", parts=2, microbatch=4, repeats=1))
    assert profile.num_parts == 2 and profile.meta["task"] == "x:y" and "calibrated_on" not in profile.meta
