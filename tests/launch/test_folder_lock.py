"""Tests for duplexpipe.launch.folder_lock: one job per folder. A second job is refused naming the holder's process
and host (also `duplexpipe train`: exit 2, one line, before any process starts); the lock of a process that died is
taken over with a warning; folders the lock created are removed again when the job left them empty."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from duplexpipe.cli import main
from duplexpipe.errors import FolderInUseError
from duplexpipe.launch.folder_lock import LOCK_FILE, FolderLock, hold_folders, process_start

HOLDER = textwrap.dedent("""
    import sys, time
    from duplexpipe.launch.folder_lock import FolderLock
    lock = FolderLock(sys.argv[1], "save")
    lock.acquire()
    print("held", flush=True)
    sys.stdin.readline()
    lock.release()
""")


@pytest.fixture
def other_job(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """Another process holding the lock of tmp_path/run until the test ends."""
    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield folder, proc.pid
    finally:
        proc.communicate("\n", timeout=30)


@pytest.mark.timeout(60)
def test_a_second_job_is_refused_naming_the_holder(other_job: tuple[Path, int]) -> None:
    folder, pid = other_job
    with pytest.raises(FolderInUseError, match=rf"save folder {folder} is in use by another job: process {pid} on "
                                               rf"host {socket.gethostname()}, started .* holds {folder / LOCK_FILE}"):
        FolderLock(folder, "save").acquire()


@pytest.mark.timeout(120)
def test_duplexpipe_train_on_a_held_folder_exits_2_before_starting(other_job: tuple[Path, int],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder, pid = other_job
    for flag in ("--save", "--out-dir"):
        code = main(["train", "--ranks", "2", "--microbatches", "4", "--batch-size", "8", "--steps", "1",
                     flag, str(folder)])
        err = capsys.readouterr().err
        role = "save" if flag == "--save" else "output"
        assert code == 2 and err.count("\n") == 1, err
        assert f"{role} folder {folder} is in use by another job: process {pid}" in err, err
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE], "the refused job wrote nothing"


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = int(done.stdout)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "started": 0}))
    lock = FolderLock(tmp_path, "output")
    with pytest.warns(UserWarning, match=rf"output folder {tmp_path}: took over the lock of process {dead} on host "
                                         ".*, which is no longer running"):
        lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_process_may_take_its_own_lock_again(tmp_path: Path) -> None:
    with hold_folders([(str(tmp_path), "save"), (str(tmp_path / "."), "output")]), warnings.catch_warnings():
        warnings.simplefilter("error")  # no take-over warning: it is this process's lock
        with hold_folders([(str(tmp_path), "save")]):
            assert (tmp_path / LOCK_FILE).exists()
        assert (tmp_path / LOCK_FILE).exists(), "the inner release leaves the outer lock"
    assert not (tmp_path / LOCK_FILE).exists()


def test_folders_the_lock_created_go_when_left_empty(tmp_path: Path) -> None:
    with hold_folders([(str(tmp_path / "a" / "b"), "save"), (str(tmp_path / "out"), "output")]):
        (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")
    assert not (tmp_path / "a").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metrics.jsonl"]
    assert os.access(tmp_path, os.W_OK)


def test_a_lock_whose_ranks_still_run_is_not_taken_over(tmp_path: Path) -> None:
    """The launcher was killed, one of its ranks still runs: refused naming it; once it ended, taken over."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = FolderLock(tmp_path, "save")
        holder.acquire()
        holder.record_ranks([rank.pid])
        info = json.loads((tmp_path / LOCK_FILE).read_text())
        assert info["ranks"] == [[rank.pid, process_start(rank.pid)]]
        info["pid"] = dead  # as the killed launcher left it
        holder.release()
        (tmp_path / LOCK_FILE).write_text(json.dumps(info))
        with pytest.raises(FolderInUseError, match=rf"the launcher process {dead} on host .* is gone, but its ranks "
                                                   rf"\(processes {rank.pid}\) still run"):
            FolderLock(tmp_path, "save").acquire()
    finally:
        rank.kill()
        rank.wait()
    lock = FolderLock(tmp_path, "save")
    with pytest.warns(UserWarning, match=f"took over the lock of process {dead}"):
        lock.acquire()
    lock.release()


def test_a_link_at_the_lock_file_is_never_written_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    code = main(["train", "--ranks", "2", "--steps", "1", "--save", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"duplexpipe: error: save folder {run}: cannot write its lock file {run / LOCK_FILE} "
                                 "(it is a symbolic link, which a run never writes through)\n"), err
    assert victim.read_text() == "mine\n" and (run / LOCK_FILE).is_symlink()
