"""Checkpoint faults for the tests: crafted metadata that would run a command, flipped and cut bytes, a manifest made
anew (as an attacker would), and file writes that fail like a full disk or a read-only folder."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo

from duplexpipe.train.checkpoint.manifest import MANIFEST_FILE, digest, write_manifest
from duplexpipe.train.checkpoint.storage import NamingFileSystem

DEEP_KEY = b"\x80\x02}K\x01" + b"\x85" * 10**6 + b"K\x01s."
"""A pickled dict whose key is a tuple nested a million deep: it names no class at all, and hashing the key overflows
the C stack (the process dies with SIGSEGV) when it is unpickled."""


class RunsCommand:
    """Unpickled by a plain unpickler, this runs `command` (os.system)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def metadata_of(folder: Path) -> Any:
    """The Metadata of a checkpoint this test wrote itself (trusted: plain pickle)."""
    return pickle.loads((folder / ".metadata").read_bytes())  # noqa: S301 - the test's own file


def remanifest(folder: Path) -> None:
    """Write the manifest anew for the files as they are now (what someone handing over a crafted checkpoint does)."""
    names = [p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE]
    write_manifest(folder, {name: digest(folder / name) for name in names})


def craft(folder: Path, marker: Path) -> None:
    """Replace the metadata with one whose planner data runs `touch marker` when unpickled, manifest made anew."""
    metadata = metadata_of(folder)
    metadata.planner_data = RunsCommand(f"touch {marker}")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    remanifest(folder)


def point_outside(folder: Path) -> None:
    """Point the metadata's first data entry at ../outside.distcp (manifest made anew)."""
    metadata = metadata_of(folder)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo("../outside.distcp", info.offset, info.length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    remanifest(folder)


def flip(path: Path, count: int = 400) -> None:
    """Flip `count` bytes in the middle of a file (its size stays)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - count // 2)
    for i in range(start, min(len(data), start + count)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def cut(path: Path, keep: float = 0.5) -> None:
    """Truncate a file to `keep` of its size."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@contextlib.contextmanager
def failing_writes(code: int = errno.ENOSPC, suffix: str = ".distcp") -> Iterator[None]:
    """Inside, the checkpoint writer's writes of files ending in `suffix` fail with OSError `code` (a full disk, a
    read-only folder)."""
    original = NamingFileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: NamingFileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            if "w" in mode and str(path).endswith(suffix):
                raise OSError(code, os.strerror(code))
            yield stream

    NamingFileSystem.create_stream = create_stream  # type: ignore[method-assign]
    try:
        yield
    finally:
        NamingFileSystem.create_stream = original  # type: ignore[method-assign]


def small_checkpoint(path: Path) -> dict[str, Any]:
    """Save a small state (tensors of several dtypes, plain values) in this process (no process group); returns it."""
    import warnings

    import torch

    from duplexpipe.train.checkpoint.folder import save_state

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
                       "steps": torch.arange(5, dtype=torch.int64)},
             "trainer": {"format": 2, "layout": "{}", "calls": 7, "optimizer_steps": 7, "fresh_optimizer": False,
                         "scaler": {"scale": 1.0, "good_steps": 0, "skipped_steps": 0},
                         "name": "x", "scale": 2.0, "flag": True}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        save_state(state, str(path))
    return state
