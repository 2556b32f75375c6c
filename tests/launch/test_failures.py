"""Tests for duplexpipe.launch.failures: the one-line error, and what a failed `duplexpipe train` prints locally
and under torchrun (2 ranks): the root cause once, at most one line per other rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from duplexpipe.errors import PeerFailedError, StoppedByPeer
from duplexpipe.launch.failures import blamed_rank, error_summary
from duplexpipe.launch.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "_bad_tasks.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
TRAIN = ["train", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "4", "--steps", "3",
         "--log-every", "0"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return env


def test_the_summary_is_the_error_not_the_notes_added_to_it() -> None:
    exc = ValueError("bad value 42\nmore detail")
    exc.add_note("duplexpipe: rank 3 failed while running 3F4; the other ranks were told to stop")
    assert error_summary(exc) == "ValueError: bad value 42"
    assert blamed_rank(PeerFailedError("rank 0: stopping because rank 1 failed: x", 1), 0) == 1
    assert StoppedByPeer(0, 1, True).args[0] == "rank 0 stopped because rank 1 failed: see rank 1's error"


@pytest.mark.timeout(120)
def test_a_local_run_prints_the_failed_ranks_error_in_one_line() -> None:
    """It printed the last line of the traceback, a note the runtime adds ("... the other ranks were told to
    stop"), instead of the error."""
    proc = subprocess.run([sys.executable, "-m", "duplexpipe.cli", *TRAIN, "--task", f"{TASKS}:loss_fails"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == "duplexpipe: error: rank 1 failed: ValueError: bad value 42 in the loss\n", proc.stderr


def _torchrun(task: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "duplexpipe.cli", *TRAIN, "--task", f"{TASKS}:{task}"]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=170)


def _ranks_output(stderr: str) -> list[str]:
    """The lines the ranks printed (torchrun's own log lines, its traceback and its summary left out)."""
    head = stderr.split("Traceback (most recent call last):", 1)[0]
    return [line for line in head.splitlines() if line.strip() and not line.startswith(("W1", "E1", "I1"))]


@pytest.mark.timeout(180)
def test_under_torchrun_the_root_cause_is_reported_once_and_the_other_rank_prints_one_line() -> None:
    """Each rank that stopped because of another printed its own shutdown traceback, and torchrun listed it
    with that traceback again."""
    proc = _torchrun("loss_fails")
    assert proc.returncode != 0
    ours = _ranks_output(proc.stderr)
    assert ours == ["rank 0 stopped because rank 1 failed: see rank 1's error",
                    "rank 1 failed: ValueError: bad value 42 in the loss"], proc.stderr[-4000:]
    failures, root = proc.stderr.split("Root Cause (first observed failure):", 1)
    assert "<NO_OTHER_FAILURES>" in failures and "[rank" not in proc.stderr, proc.stderr[-4000:]
    assert "rank      : 1 (local_rank: 1)" in root and "ValueError: bad value 42 in the loss" in root
    assert proc.stderr.count("Traceback (most recent call last)") == 2  # torchrun's own, and the root cause's


@pytest.mark.timeout(180)
def test_under_torchrun_an_error_every_rank_raises_is_reported_by_the_lowest_rank() -> None:
    proc = _torchrun("batch_fails")
    assert proc.returncode != 0
    ours = _ranks_output(proc.stderr)
    assert sorted(ours) == ["rank 0 failed: ValueError: bad value 4 in the batch",
                            "rank 1 failed the same way as rank 0: see rank 0's error"], proc.stderr[-4000:]
    failures, root = proc.stderr.split("Root Cause (first observed failure):", 1)
    assert "<NO_OTHER_FAILURES>" in failures and "rank      : 0 (local_rank: 0)" in root
