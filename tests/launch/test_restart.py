"""Crash restart: `duplexpipe train` under `torchrun --max-restarts 1` with one rank SIGKILLed mid-run finishes by
itself from its newest complete checkpoint, and its final checkpoint is bit-equal to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from duplexpipe.launch.train_loop import run_training
from duplexpipe.launch.train_settings import merge_config, settings
from duplexpipe.train.checkpoint import read_checkpoint

TASK = str(Path(__file__).resolve().parents[1] / "_crash_task.py") + ":crash_task"
OPTIONS = {"n_layer": 2, "d_model": 16, "n_head": 2, "block_size": 16}
RUN = {"pipeline.schedule": "1f1b", "ranks": 2, "pipeline.num_microbatches": 2, "batch_size": 8, "steps": 12,
       "checkpoint.save_every": 3, "metrics.log_every": 0, "metrics.tensorboard": False,
       "pipeline.safety.timeout_s": 60.0}
"""PP=2, 1F1B, 12 steps, a checkpoint every 3."""
KILL_STEP = 6
"""0-based: rank 1 dies fetching the batch of step 7 (after the checkpoint of step 6)."""


def _flags() -> list[str]:
    flags = []
    named = {s.key: s.flags[0] for s in settings()}
    for key, value in RUN.items():
        if value is False:
            flags.append("--no-" + named[key].removeprefix("--"))
        else:
            flags += [named[key], str(value)]
    for key, value in OPTIONS.items():
        flags += ["--task-option", f"{key}={value}"]
    return flags


@pytest.mark.timeout(420)
def test_a_killed_rank_is_restarted_and_the_job_finishes_bit_equal(tmp_path: Path) -> None:
    crashed, straight = tmp_path / "crashed", tmp_path / "straight"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "duplexpipe.cli", "train", "--task", TASK,
               *_flags(), "--task-option", f"kill_step={KILL_STEP}", "--task-option", f"mark={tmp_path / 'killed'}",
               "--save", str(crashed), "--keep", "2",
               "--out-dir", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=360, cwd=tmp_path, env=env)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    # rank 1 was killed on the first attempt and torchrun saw the attempt fail (which worker it names first, the
    # killed one or one it stopped, is a race of its monitor)
    assert (tmp_path / "killed").read_text() == f"rank 1 killed fetching step {KILL_STEP}\n"
    assert "failed (exitcode:" in log, log[-4000:]
    assert sorted(p.name for p in crashed.iterdir()) == ["latest", "step-000009", "step-000012"]  # --keep 2
    assert (crashed / "latest").read_text().strip() == "step-000012"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13)), "the restarted attempt continued after step 6, once"

    run_training(merge_config({}, {"task": TASK, "task_options": dict(OPTIONS), "checkpoint.save": str(straight),
                                   **RUN}))
    want = read_checkpoint(str(straight / "step-000012"))
    got = read_checkpoint(str(crashed / "step-000012"))
    assert set(got) == set(want) and any(k.startswith("optim.state.") for k in got)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
