"""One job per folder: a lock file naming the holder's host and process id (and its ranks'), held (flock) while the job
runs; a second job is refused naming the holder, and the lock of a job whose processes all ended is taken over with a
warning."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from duplexpipe.errors import FolderInUseError
from duplexpipe.files import NOFOLLOW, refused_link
from duplexpipe.launch.train_config import TrainConfig

LOCK_FILE = ".duplexpipe.lock"
"""The lock file a job keeps in each folder it writes (save and output folders) while it runs."""
_MAX_LOCK_BYTES = 4096

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the process id alone decides
    fcntl = None  # type: ignore[assignment]


def _holder_text(info: dict[str, Any]) -> str:
    started = info.get("started")
    when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if isinstance(
        started, (int, float)) else ""
    return f"process {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, _MAX_LOCK_BYTES)
    try:
        info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"pid": "?", "host": "?"}
    return info if isinstance(info, dict) else {"pid": "?", "host": "?"}


def _alive(pid: object) -> bool:
    """True when process `pid` runs on this host (or cannot be asked)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/`pid`/stat after the command name (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When process `pid` started (Linux: clock ticks since boot, from /proc), None where unknown: with the process
    id it names one process, not a later one that reuses the id."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def _ended(pid: int) -> bool:
    """True when process `pid` has exited and only waits to be reaped (a zombie: its parent died before it)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("Z", "X")


def _still_running(info: dict[str, Any]) -> list[int]:
    """The processes of the job `info` describes (its ranks) that still run on this host."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("ranks"), list):
        return []
    alive = []
    for entry in info["ranks"]:
        if not (isinstance(entry, list) and len(entry) == 2 and _alive(entry[0])) or _ended(entry[0]):
            continue
        start = process_start(entry[0])
        if start is None or entry[1] is None or start == entry[1]:
            alive.append(entry[0])
    return alive


def _mine(info: dict[str, Any]) -> bool:
    return info.get("host") == socket.gethostname() and info.get("pid") == os.getpid()


class FolderLock:
    """The lock of one folder, taken by `acquire` (creating the folder) and given back by `release`."""

    def __init__(self, folder: str | os.PathLike[str], role: str) -> None:
        self.folder = Path(folder)
        self.role = role
        """What the folder is to the job ("save", "output"): named in the errors."""
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._created: list[Path] = []  # the folders `acquire` created, innermost first


    def acquire(self) -> None:
        """Hold the folder's lock. FolderInUseError names the holder when another live job has it; ValueError when
        the folder cannot be created or written. Already held by this process: nothing to do."""
        missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{self.role} folder {self.folder}: cannot create it ({exc.strerror})") from None
        self._created = missing
        for _ in range(5):  # the lock file may be replaced while we open it: try again
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
            except OSError as exc:
                raise ValueError(f"{self.role} folder {self.folder}: cannot write its lock file {self.path} "
                                 f"({refused_link(exc, self.path).strerror})") from None
            if self._take(fd):
                return
        raise FolderInUseError(f"{self.role} folder {self.folder}: its lock file {self.path} keeps changing; is "
                               "another job starting on it?")

    def _take(self, fd: int) -> bool:
        """Lock `fd` (the lock file) and write this process into it; False when the file was replaced meanwhile."""
        try:
            held_elsewhere = not self._flock(fd)
            info = _read(fd)
            if held_elsewhere or (fcntl is None and info and _alive(info.get("pid")) and not _mine(info)):
                if _mine(info):  # this process holds it already (the command line, then run_training)
                    os.close(fd)
                    return True
                raise FolderInUseError(f"{self.role} folder {self.folder} is in use by another job: "
                                       f"{_holder_text(info)} holds {self.path}; wait for it to end or use another "
                                       "folder")
            running = [] if _mine(info) else _still_running(info)
            if running:
                raise FolderInUseError(f"{self.role} folder {self.folder} is in use by another job: the launcher "
                                       f"{_holder_text(info)} is gone, but its ranks (processes "
                                       f"{', '.join(map(str, running))}) still run; wait for them to end or stop "
                                       "them")
            if os.fstat(fd).st_ino != os.lstat(self.path).st_ino:
                os.close(fd)
                return False
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        if info and not _mine(info):
            warnings.warn(f"{self.role} folder {self.folder}: took over the lock of {_holder_text(info)}, which is "
                          "no longer running", UserWarning, stacklevel=4)
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                           "role": self.role}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
        os.fsync(fd)
        self._fd = fd
        return True

    @staticmethod
    def _flock(fd: int) -> bool:
        """True when this process now holds the exclusive flock of `fd` (or the file system has none)."""
        if fcntl is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # no flock here: the pid decides
                info = _read(fd)
                return not (info and _alive(info.get("pid")) and not _mine(info))
            raise
        return True

    def record_ranks(self, pids: Iterable[int]) -> None:
        """Name the job's rank processes in the lock file this process holds (with when each started), so that the
        lock is not taken over while one of them still runs, even after the launcher was killed."""
        try:
            fd = os.open(self.path, os.O_RDWR | NOFOLLOW)
        except OSError:
            return
        try:
            info = _read(fd)
            if _mine(info):
                info["ranks"] = [[pid, process_start(pid)] for pid in pids]
                body = json.dumps(info).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, body, 0)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Give the lock back: remove the lock file if it is still ours, and the folders `acquire` created if the job
        left them empty."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.lstat(self.path).st_ino:
                self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(fd)
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # not empty: the job wrote something there
                break


def job_folders(config: TrainConfig) -> list[tuple[str | None, str]]:
    """The folders a training run writes, and locks: the save folder and the output folder."""
    return [(config.checkpoint.save, "save"), (config.metrics.out_dir, "output")]


@contextlib.contextmanager
def hold_folders(folders: Iterable[tuple[str | None, str]]) -> Iterator[list[FolderLock]]:
    """Hold the locks of the (folder, role) pairs (None folders skipped, one lock per real folder) while the body
    runs (it gets them: `FolderLock.record_ranks`); FolderInUseError (a ValueError) before the body when another job
    holds one."""
    locks: list[FolderLock] = []
    seen: set[str] = set()
    try:
        for folder, role in folders:
            if folder is None or os.path.realpath(folder) in seen:
                continue
            seen.add(os.path.realpath(folder))
            lock = FolderLock(folder, role)
            lock.acquire()
            locks.append(lock)
        yield locks
    finally:
        for lock in reversed(locks):
            lock.release()
