"""`duplexpipe train` owns its ranks: SIGTERM, SIGHUP or SIGKILL to the launcher ends every rank within seconds, and
the next job on the folder resumes exactly where the killed one saved last (writing none of its files through a
symbolic link planted at its name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _failing_ranks import exited

from duplexpipe.cli import main as cli_main
from duplexpipe.launch.checkpoints import LATEST
from duplexpipe.launch.folder_lock import LOCK_FILE

TASKS = Path(__file__).resolve().parents[1] / "_bad_tasks.py"
STEPS = 16
RUN = [sys.executable, "-m", "duplexpipe.cli", "train", "--task", f"{TASKS}:plain", "--schedule", "1f1b",
       "--ranks", "2", "--microbatches", "2", "--batch-size", "4", "--steps", str(STEPS), "--save-every", "2",
       "--log-every", "0", "--no-tensorboard", "--timeout", "60"]
"""PP=2, 1F1B, a checkpoint every 2 steps: long enough to be killed after its first checkpoint."""



def _wait_for(what: str, ready: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.05)


def _killed(save: Path, name: str, after: str) -> None:
    """Start the job on `save`, send the launcher signal `name` once it saved a checkpoint newer than `after`, and
    check that it and both ranks ended (the ranks within 10 s)."""
    number = getattr(signal, name)
    job = subprocess.Popen([*RUN, "--save", str(save)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        _wait_for(f"checkpoint after {after or 'none'}",
                  lambda: (save / LATEST).is_file() and (save / LATEST).read_text().strip() > after, 120)
        ranks = [pid for pid, _ in json.loads((save / LOCK_FILE).read_text())["ranks"]]
        assert len(ranks) == 2 and job.poll() is None, "the job ended before it was killed"
        os.kill(job.pid, number)
        _, err = job.communicate(timeout=30)
        _wait_for(f"end of every rank after {name}", lambda: all(exited(pid) for pid in ranks), 10)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    if number == signal.SIGKILL:
        assert job.returncode == -number
    else:  # the launcher stopped its ranks itself, said so, and gave its folder back
        assert job.returncode == 128 + number, err
        assert err.splitlines()[-1] == f"duplexpipe: stopped by {name}: stopping the ranks", err
        assert not (save / LOCK_FILE).exists()


def _plant_links(save: Path, out: Path) -> list[tuple[Path, Path]]:
    """Links at the names of the files the last job writes (its outputs, its final checkpoint's), each to a file of
    the user's beside the run."""
    final = save / f"step-{STEPS:06d}"
    final.mkdir()
    out.mkdir()
    planted = []
    for link in [out / name for name in ("losses.json", "metrics.jsonl", "partition.txt", "timeline.json")] + [
            final / name for name in ("__0_0.distcp", "__1_0.distcp", "manifest.json")]:
        victim = save.parent / f"victim-{link.name}"
        victim.write_text("the user's\n")
        link.symlink_to(victim)
        planted.append((link, victim))
    return planted


@pytest.mark.timeout(600)
def test_a_killed_launcher_takes_its_ranks_along(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM, SIGHUP and SIGKILL in turn, each to a job that resumed the one killed before it (one folder: three
    kills cost three starts, not six); the last job then resumes and ends exactly as the run uninterrupted."""
    straight, save, out = tmp_path / "straight", tmp_path / "save", tmp_path / "out"
    assert cli_main([*RUN[3:], "--out-dir", str(straight)]) == 0, capsys.readouterr().err
    newest = ""
    for name in ("SIGTERM", "SIGHUP", "SIGKILL"):
        _killed(save, name, newest)
        newest = (save / LATEST).read_text().strip()
    victims = _plant_links(save, out)
    assert cli_main([*RUN[3:], "--save", str(save), "--out-dir", str(out)]) == 0, capsys.readouterr().err
    for link, victim in victims:  # what the run wrote replaced the links, never wrote through them
        assert link.is_file() and not link.is_symlink() and victim.read_text() == "the user's\n", link
    want = json.loads((straight / "losses.json").read_text())["losses"]
    resumed = json.loads((out / "losses.json").read_text())
    start = resumed["start_step"]
    assert start == int(newest.split("-")[1]) and 6 <= start < STEPS, (start, newest)
    assert resumed["losses"] == want[start:], (start, resumed["losses"], want)
