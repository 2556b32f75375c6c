"""Rank functions whose errors arrive in a forced order, for the launcher's root-cause tests.

Run as a script under torchrun: `torchrun --nproc-per-node 2 tests/_failing_ranks.py FLAG_FILE`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from duplexpipe.errors import PeerFailedError, StoppedByPeer
from duplexpipe.launch.processes import run

OWN_ERROR = "the originating error on rank 0"


def exited(pid: int) -> bool:
    """True once process `pid` has exited (gone, or a zombie not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def consequence_first(kind: str, flag: str) -> None:
    """Rank 1 fails with an error that only reports rank 0's failure; rank 0 raises its own error
    only after that: after rank 1's process exited (flag "exit", the local launcher has rank 1's
    report by then), or after rank 1 created the file `flag` (under torchrun, where rank 1 waits)."""
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        if flag != "exit":
            Path(flag).touch()
        if kind == "peer":
            raise PeerFailedError("rank 1: stopping because rank 0 failed: (see rank 0)", 0)
        raise ValueError("rank 0 rejected its step inputs (see its error); nothing was run")
    if dist.get_rank() == 0:
        while not (exited(pids[1]) if flag == "exit" else Path(flag).exists()):
            time.sleep(0.01)
        raise ValueError(OWN_ERROR)


def blame_a_silent_rank() -> None:
    """Rank 1 blames rank 0, which never fails (it sleeps until it is killed)."""
    if dist.get_rank() == 1:
        raise ValueError("rank 0 rejected its step inputs (see its error); nothing was run")
    time.sleep(600)


if __name__ == "__main__":
    try:
        run(consequence_first, 2, ("rejected", sys.argv[1]))
    except StoppedByPeer as stopped:  # as `duplexpipe train` ends such a rank: quietly beside its cause, so
        sys.exit(0 if stopped.same_node else 1)  # torchrun never sees it fail before the cause does
