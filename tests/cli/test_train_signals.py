"""`duplexpipe train` owns its ranks: SIGTERM, SIGHUP or SIGKILL to the launcher ends every rank within seconds, and
the next job on the folder resumes exactly where the killed one saved last."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from duplexpipe.launch.checkpoints import LATEST
from duplexpipe.launch.folder_lock import LOCK_FILE

TASKS = Path(__file__).resolve().parents[1] / "_bad_tasks.py"
STEPS = 40
RUN = [sys.executable, "-m", "duplexpipe.cli", "train", "--task", f"{TASKS}:plain", "--schedule", "1f1b",
       "--ranks", "2", "--microbatches", "2", "--batch-size", "4", "--steps", str(STEPS), "--save-every", "2",
       "--log-every", "0", "--no-tensorboard", "--timeout", "60"]
"""PP=2, 1F1B, a checkpoint every 2 steps: long enough to be killed after its first checkpoint."""


def _gone(pid: int) -> bool:
    """True once process `pid` has ended (gone, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_for(what: str, ready: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the run uninterrupted."""
    out = tmp_path_factory.mktemp("straight")
    done = subprocess.run([*RUN, "--out-dir", str(out)], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads((out / "losses.json").read_text())["losses"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_killed_launcher_takes_its_ranks_along(name: str, tmp_path: Path, straight: list[float]) -> None:
    number = getattr(signal, name)
    save, out = tmp_path / "save", tmp_path / "out"
    job = subprocess.Popen([*RUN, "--save", str(save)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        _wait_for("checkpoint", (save / LATEST).is_file, 120)
        ranks = [pid for pid, _ in json.loads((save / LOCK_FILE).read_text())["ranks"]]
        assert len(ranks) == 2 and job.poll() is None
        os.kill(job.pid, number)
        _, err = job.communicate(timeout=30)
        _wait_for("end of every rank", lambda: all(_gone(pid) for pid in ranks), 10)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    if number == signal.SIGKILL:
        assert job.returncode == -number
    else:  # the launcher stopped its ranks itself, said so, and gave its folder back
        assert job.returncode == 128 + number, err
        assert err.splitlines()[-1] == f"duplexpipe: stopped by {name}: stopping the ranks", err
        assert not (save / LOCK_FILE).exists()

    done = subprocess.run([*RUN, "--save", str(save), "--out-dir", str(out)], capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    resumed = json.loads((out / "losses.json").read_text())
    start = resumed["start_step"]
    assert 2 <= start < STEPS and resumed["losses"] == straight[start:], (start, resumed["losses"], straight)
