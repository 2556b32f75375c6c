"""Checkpoint folders written and read through torch.distributed.checkpoint with duplexpipe's safety: the safe reader,
the manifest written after every rank finished and checked before anything is read, a failed save's partial folder
removed, and DCP's CheckpointException turned into one error naming the first failing rank's cause and file."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import LoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from duplexpipe.errors import CheckpointError
from duplexpipe.train.checkpoint.manifest import (
    MANIFEST_FILE,
    FileDigest,
    check_files,
    damaged,
    digest,
    read_manifest,
    share,
    write_manifest,
)
from duplexpipe.train.checkpoint.names import format_problems
from duplexpipe.train.checkpoint.storage import (
    FILE_ATTRIBUTE,
    METADATA_FILE,
    CheckpointReader,
    CheckpointWriter,
    read_metadata_file,
)

T = TypeVar("T")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _everyone(value: T) -> list[T]:
    """Every rank's `value` (this rank's alone without a process group)."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _from_rank0(value: T) -> T:
    """Rank 0's `value` on every rank."""
    if not _distributed():
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def failure(exc: CheckpointException, path: str, verb: str) -> CheckpointError:
    """One error for a failed DCP save or load: the first failing rank's root error and the file it was in
    ("No space left on device while writing run/step-000030/__0_0.distcp (rank 0)")."""
    failures = exc.failures
    rank = min(failures)
    root: BaseException = failures[rank][0]
    while isinstance(root, CheckpointException) and root.failures:  # nested: the innermost rank's error
        root = root.failures[min(root.failures)][0]
    file = getattr(root, FILE_ATTRIBUTE, None)
    where = f"{path}/{Path(file).name}" if file else path
    others = sorted(r for r in failures if r != rank)
    also = f"; ranks {others} failed too" if others else ""
    if isinstance(root, OSError) and root.strerror:
        return CheckpointError(f"{root.strerror} while {verb} {where} (rank {rank}{also})")
    if verb == "reading":
        name = Path(file).name if file else METADATA_FILE
        return CheckpointError(f"checkpoint {path} is incomplete or corrupt ({name}: {type(root).__name__}: "
                               f"{str(root).splitlines()[0] if str(root) else ''}) (rank {rank}{also})")
    return CheckpointError(f"{type(root).__name__}: {root} while {verb} {where} (rank {rank}{also})")


def save_state(state: dict[str, Any], path: str) -> None:
    """dcp.save `state` to folder `path` (all ranks call), then the manifest: each rank's data files' checksums,
    gathered, written by rank 0 with the metadata's. A failure raises the same CheckpointError on every rank after
    rank 0 removed the folder when this save created it (a folder that was there before is left as it is)."""
    created = not Path(path).exists()
    writer = CheckpointWriter(path)
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as exc:
        error = failure(exc, path, "writing")
        _discard(path, any(_everyone(created)))
        raise error from None
    try:
        mine: dict[str, FileDigest] | str = {name: digest(Path(path) / name) for name in writer.written}
    except OSError as exc:
        mine = f"{exc.strerror} while reading {path}/{Path(exc.filename or '').name} back (rank {_rank()})"
    gathered = _everyone((mine, created))
    message = _write_manifest(path, [m for m, _ in gathered]) if _rank() == 0 else None
    message = _from_rank0(message)
    if message is not None:
        _discard(path, any(c for _, c in gathered))
        raise CheckpointError(message)


def _write_manifest(path: str, parts: list[dict[str, FileDigest] | str]) -> str | None:
    """Rank 0: the manifest of every rank's files and the metadata; the error message when it cannot be written."""
    failed = next((p for p in parts if isinstance(p, str)), None)
    if failed is not None:
        return failed
    files: dict[str, FileDigest] = {}
    for part in parts:
        assert isinstance(part, dict)
        files.update(part)
    try:
        files[METADATA_FILE] = digest(Path(path) / METADATA_FILE)
        write_manifest(path, files)
    except OSError as exc:
        return f"{exc.strerror} while writing {path}/{MANIFEST_FILE} (rank 0)"
    return None


def _discard(path: str, created: bool) -> None:
    """Rank 0 removes the folder of a failed save when the save created it; every rank calls it and returns once the
    folder is gone (a rank that raised first could end the job, its launcher stopping rank 0 mid-removal)."""
    if created and _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    if _distributed():
        dist.barrier()


def verify_files(path: str, collective: bool) -> None:
    """Check the files of checkpoint `path` against its manifest before anything is read: shared among the ranks
    when `collective` (every rank raises the same CheckpointError), else all here. A checkpoint without a manifest
    (saved before manifests existed) loads with one warning."""
    files = read_manifest(path)
    if files is None:
        if _rank() == 0:
            warnings.warn(f"checkpoint {path} has no {MANIFEST_FILE} (saved by an older duplexpipe or another "
                          "tool): its files are not verified", UserWarning, stacklevel=4)
        return
    if METADATA_FILE not in files:
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST_FILE} does not list {METADATA_FILE}")
    spread = collective and _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if spread else (0, 1)
    problems = check_files(path, files, share(list(files), rank, world))
    if spread:
        problems = sorted(p for mine in _everyone(problems) for p in mine)
    if problems:
        raise damaged(path, problems)


def located_problems(path: str, metadata: Metadata, files: dict[str, FileDigest] | None) -> list[str]:
    """What is wrong with where `metadata` puts the bytes of checkpoint `path`: a data file the manifest `files`
    does not list, a missing one, one shorter than the bytes read from it (one line each; [] when none). The reader,
    resume and `checkpoint verify` all check this before reading: nothing is allocated for bytes that are not there."""
    root = Path(path)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        if files is not None and name not in files:
            problems.append(f"{METADATA_FILE} points at {name}, which the manifest does not list")
        size = (root / name).stat().st_size if (root / name).is_file() else None
        if size is None and (files is None or name not in files):  # a listed file was reported already
            problems.append(f"{name} is missing")
        elif size is not None and size < end:
            problems.append(f"{name} has {size:,} bytes, but {METADATA_FILE} reads up to byte {end:,}")
    return problems


def read_checked_metadata(path: str) -> Metadata:
    """The checked Metadata of checkpoint `path`, its `.metadata` first checked against the manifest when it has one
    (size and SHA-256): a metadata file changed since the save is refused without being unpickled; then where it
    puts the bytes (`located_problems`)."""
    files = read_manifest(path)
    if files is not None:
        if METADATA_FILE not in files:
            raise CheckpointError(f"checkpoint {path}: its {MANIFEST_FILE} does not list {METADATA_FILE}")
        problems = check_files(path, files, [METADATA_FILE])
        if problems:
            raise damaged(path, problems)
    metadata = read_metadata_file(path)
    problems = located_problems(path, metadata, files)
    if problems:
        raise damaged(path, problems)
    return metadata


def load_state(state: dict[str, Any], path: str, planner: LoadPlanner, *, no_dist: bool = False) -> None:
    """dcp.load `state` from `path` through the safe reader; a failure is one CheckpointError naming the cause."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=CheckpointReader(path), planner=planner, no_dist=no_dist)
    except CheckpointException as exc:
        raise failure(exc, path, "reading") from None


def verify_checkpoint(path: str) -> tuple[list[str], str]:
    """Check checkpoint folder `path` without loading it: every file against the manifest, the metadata read
    safely, every data file it points at listed and long enough, and what resume needs whatever the model
    (`names.format_problems`). Returns (problems, one-line summary of what was
    checked); CheckpointError when `path` is not a checkpoint folder at all."""
    root = Path(path)
    if not root.is_dir() or not ((root / METADATA_FILE).exists() or (root / MANIFEST_FILE).exists()):
        raise CheckpointError(f"{path} is not a checkpoint folder (no {METADATA_FILE} and no {MANIFEST_FILE})")
    files = read_manifest(path)
    problems = [f"it has no {MANIFEST_FILE}: its files cannot be verified (saved by an older duplexpipe or "
                "another tool)"] if files is None else check_files(path, files, sorted(files))
    if files is not None and (METADATA_FILE not in files or any(p.startswith(f"{METADATA_FILE} ") for p in problems)):
        # not what was saved: never unpickled
        return problems or [f"its {MANIFEST_FILE} does not list {METADATA_FILE}"], f"{len(files)} files in the manifest"
    try:
        metadata = read_metadata_file(path)
    except CheckpointError as exc:
        return problems + [str(exc)], f"{len(files or {})} files in the manifest"
    problems += located_problems(path, metadata, files) + format_problems(metadata.state_dict_metadata)
    ends = {info.relative_path for info in (metadata.storage_data or {}).values()}
    total = sum(d.size for d in (files or {}).values())
    summary = (f"{len(files or {})} files ({total:,} bytes) match their SHA-256, {len(metadata.state_dict_metadata)} "
               f"entries in {len(ends)} data files")
    return sorted(set(problems), key=problems.index), summary
