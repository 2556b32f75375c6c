"""A checkpoint's manifest: the size and SHA-256 of every file it holds, written once every rank finished saving;
checking files against it names the first one that is missing or differs."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from duplexpipe.errors import CheckpointError
from duplexpipe.files import plain_name, read_capped, write_atomic

MANIFEST_FILE = "manifest.json"
"""The manifest's name in a checkpoint folder."""
MANIFEST_FORMAT = "duplexpipe-checkpoint-manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 * 2**20
"""Largest manifest read (64 MiB: about half a million files)."""
_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class FileDigest:
    """One file's size and SHA-256."""

    size: int
    """Bytes."""
    sha256: str
    """Hex digest of its bytes."""


def digest(path: str | os.PathLike[str]) -> FileDigest:
    """The size and SHA-256 of a file (read in 8 MiB chunks)."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return FileDigest(size, sha.hexdigest())


def write_manifest(folder: str | os.PathLike[str], files: Mapping[str, FileDigest]) -> None:
    """Write the manifest of `files` (names in `folder`) atomically: readers see none or the whole one."""
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "algorithm": "sha256",
            "files": {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(files.items())}}
    write_atomic(Path(folder) / MANIFEST_FILE, json.dumps(body, indent=1) + "\n")


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, FileDigest] | None:
    """The files the manifest of `folder` lists (None when it has none); CheckpointError when it is malformed or
    names a file outside the folder."""
    path = Path(folder) / MANIFEST_FILE
    try:
        raw = read_capped(path, MAX_MANIFEST_BYTES, "checkpoint manifest", CheckpointError)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw)
        if data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
        files = {plain_name(name, f"checkpoint manifest {path}", CheckpointError): _entry(entry)
                 for name, entry in data["files"].items()}
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is corrupt ({type(exc).__name__}: {exc})") from None
    return files


def _entry(entry: dict[str, object]) -> FileDigest:
    size, sha = entry["size"], entry["sha256"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str) or len(sha) != 64:
        raise ValueError(f"bad entry {entry!r}")
    return FileDigest(size, sha)


def check_files(folder: str | os.PathLike[str], files: Mapping[str, FileDigest], names: Iterable[str]) -> list[str]:
    """What is wrong with files `names` of `folder` against the manifest `files` (missing, another size, another
    checksum), one line each; [] when they are intact."""
    problems = []
    for name in names:
        want = files[name]
        path = Path(folder) / name
        try:
            size = path.stat().st_size
            got = digest(path) if size == want.size else None
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as exc:
            problems.append(f"{name} cannot be read ({exc.strerror})")
            continue
        if got is None:
            problems.append(f"{name} has {size} bytes, the manifest recorded {want.size} (truncated or changed)")
        elif got.sha256 != want.sha256:
            problems.append(f"{name} differs from the checksum the manifest recorded (changed or damaged since it "
                            "was saved)")
    return problems


def share(names: Sequence[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` checks (every world-th, sorted), so that ranks share the reading."""
    return sorted(names)[rank::world]


def damaged(folder: str | os.PathLike[str], problems: Sequence[str]) -> CheckpointError:
    """The error for a checkpoint whose files do not match its manifest (the first problem, and how many)."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckpointError(f"checkpoint {folder} is incomplete or corrupt: {problems[0]}{more}; load an older "
                           f"checkpoint (see 'duplexpipe checkpoint verify {folder}')")
