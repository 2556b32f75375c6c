"""`resume auto` past a damaged checkpoint: the newest intact checkpoint of a save folder, chosen by every rank
together; the damaged ones are named in a warning and set aside, never deleted."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from duplexpipe.errors import CheckpointError
from duplexpipe.launch.checkpoints import RESUME_AUTO, publish, resume_candidates, set_aside
from duplexpipe.train.checkpoint import read_checked_metadata
from duplexpipe.train.checkpoint.folder import verify_files

__all__ = ["RESUME_AUTO", "intact_checkpoint"]


def _lead() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def intact_checkpoint(save_dir: str) -> str | None:
    """The newest checkpoint of `save_dir` whose files match its manifest and whose metadata reads (collective when
    a process group runs: the ranks share the checking). Each damaged newer one is named in a warning on stderr
    (rank 0), set aside as `<name>.damaged`, and `latest` then names the one chosen. CheckpointError (the newest's)
    when none is intact; None when the folder has no `latest`."""
    candidates = resume_candidates(save_dir)
    damaged: list[tuple[Path, CheckpointError]] = []
    for path in candidates:
        try:
            verify_files(str(path), collective=True)
            read_checked_metadata(str(path))
        except CheckpointError as exc:
            damaged.append((path, exc))
            continue
        if damaged and _lead():
            for bad, why in damaged:
                kept = set_aside(bad)
                print(f"duplexpipe: warning: {why}; resuming from the older {path} instead (the damaged one is kept "
                      f"as {kept})", file=sys.stderr, flush=True)
            publish(save_dir, path.name)
        if damaged and dist.is_initialized():
            dist.barrier()  # the damaged ones are set aside before any rank goes on
        return str(path)
    if damaged:
        raise damaged[0][1]
    return None
