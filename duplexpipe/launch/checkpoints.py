"""A run's checkpoint directory: `step-NNNNNN` checkpoints, a `latest` file written atomically once a checkpoint
is complete on every rank, the newest K kept, and which checkpoint a resumed run loads."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from duplexpipe.files import read_capped_text, write_atomic

LATEST = "latest"
"""The file in a save directory that names its newest complete checkpoint."""
_STEP = re.compile(r"^step-(\d+)$")
RESUME_AUTO = "auto"
"""`resume` value: the newest complete checkpoint of the save directory, or a fresh start when it has none."""
RESUME_NONE = "none"
"""`resume` value: a fresh start even when the save directory holds checkpoints."""
MAX_LATEST_BYTES = 4096
"""Largest `latest` file read (it holds one folder name)."""


def step_name(step: int) -> str:
    """The directory name of the checkpoint after `step` steps."""
    return f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    """True when torch.distributed.checkpoint finished writing `path` (its .metadata comes last)."""
    return (path / ".metadata").is_file()


def latest_checkpoint(save_dir: str) -> Path | None:
    """The checkpoint `save_dir/latest` names (None without a `latest` file); ValueError when it names no complete
    checkpoint."""
    root = Path(save_dir)
    marker = root / LATEST
    if not marker.is_file():
        return None
    name = read_capped_text(marker, MAX_LATEST_BYTES, "'latest' file").strip()
    target = root / name
    if not _STEP.match(name) or not is_complete(target):
        raise ValueError(f"resume: {marker} names {name!r}, which is not a complete checkpoint")
    return target


def checkpoint_to_load(path: str) -> str:
    """The checkpoint directory `path` names: itself, or the one its `latest` file names."""
    root = Path(path)
    found = latest_checkpoint(path)
    if found is not None:
        return str(found)
    if is_complete(root):
        return str(root)
    raise ValueError(f"resume: {path} holds no checkpoint (no '{LATEST}' file and no .metadata)")


def resume_from(resume: str | None, save: str | None) -> str | None:
    """The checkpoint a run continues from: `resume` "auto" (the default with `save`): the save directory's newest
    complete checkpoint, or None (a fresh start) when it has none; "none" or None without `save`: None; a path:
    that checkpoint or save directory (ValueError when it holds none)."""
    mode = resume if resume is not None else (RESUME_AUTO if save is not None else RESUME_NONE)
    if mode == RESUME_NONE:
        return None
    if mode == RESUME_AUTO:
        if save is None:
            raise ValueError("resume 'auto' continues from the --save directory; give --save")
        found = latest_checkpoint(save)
        return str(found) if found is not None else None
    return checkpoint_to_load(mode)


def resume_candidates(save_dir: str) -> list[Path]:
    """What `resume auto` may continue from, in the order it tries them: the checkpoint `latest` names, then the
    complete step folders older than it, newest first ([] without a `latest` file)."""
    root = Path(save_dir)
    marker = root / LATEST
    if not marker.is_file():
        return []
    name = read_capped_text(marker, MAX_LATEST_BYTES, "'latest' file").strip()
    match = _STEP.match(name)
    if match is None:
        raise ValueError(f"resume: {marker} names {name!r}, which is not a checkpoint folder")
    newest = int(match.group(1))
    return [path for step, path in reversed(_steps(root)) if step <= newest and is_complete(path)]


def set_aside(path: Path) -> Path:
    """Rename damaged checkpoint `path` to `<name>.damaged` (or .damaged-2, ...) beside it: kept for a look, out of
    the way of the run that saves that step again and of pruning. Returns the new path."""
    for n in range(1, 1000):
        target = path.with_name(f"{path.name}.damaged" + (f"-{n}" if n > 1 else ""))
        if not target.exists():
            path.rename(target)
            return target
    raise ValueError(f"{path}: cannot set it aside (too many damaged copies beside it)")


def publish(save_dir: str, name: str, keep: int = 0) -> None:
    """Name `name` the latest checkpoint (atomically: readers see the old name or the new one), then delete the
    checkpoints older than the newest `keep` complete ones (0: keep all). Call once every rank finished saving."""
    root = Path(save_dir)
    write_atomic(root / LATEST, name + "\n")
    if keep > 0:
        prune(root, name, keep)


def discard_partial(save_dir: str, name: str) -> None:
    """Remove step folder `name` of a save that failed (unless `latest` names it: that one is left as it is)."""
    marker = Path(save_dir) / LATEST
    named = marker.is_file() and marker.read_text(encoding="utf-8", errors="replace").strip() == name
    if _STEP.match(name) and not named:
        shutil.rmtree(Path(save_dir) / name, ignore_errors=True)


def _steps(root: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name)))


def step_folders(root: str | Path) -> list[Path]:
    """The step-NNNNNN folders of a save folder, oldest first."""
    return [path for _, path in _steps(Path(root))]


def prune(root: Path, latest: str, keep: int) -> list[str]:
    """Delete the step directories older than `latest` except the newest `keep` - 1 complete ones (directories newer
    than `latest` are left: a crashed attempt's leftovers, overwritten when that step is saved again)."""
    newest = int(_STEP.match(latest).group(1))  # type: ignore[union-attr]
    older = [(step, path) for step, path in _steps(root) if step < newest]
    kept = {path for _, path in [(s, p) for s, p in older if is_complete(p)][-(keep - 1):]} if keep > 1 else set()
    removed = []
    for _, path in older:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed
