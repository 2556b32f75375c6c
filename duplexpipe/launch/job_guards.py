"""What a training job guards while it runs: its folders locked for it (by the launcher, or by rank 0 under torchrun)
and the same batch from `task.batch()` on every rank."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from duplexpipe.errors import InputRejected
from duplexpipe.launch.folder_lock import hold_folders, job_folders
from duplexpipe.launch.train_config import TrainConfig


@contextlib.contextmanager
def locked_by_rank0(config: TrainConfig) -> Iterator[None]:
    """Under torchrun: rank 0 holds the run's folder locks while the body runs; every rank raises the same
    InputRejected (exit 2) when another job holds one (collective: every rank enters)."""
    with contextlib.ExitStack() as stack:
        error = None
        if dist.get_rank() == 0:
            try:
                stack.enter_context(hold_folders(job_folders(config)))
            except ValueError as exc:
                error = str(exc)
        box: list[Any] = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise InputRejected(box[0])
        yield


def batch_fingerprint(inputs: Any, targets: Any) -> int:
    """A 63-bit hash of every tensor of a batch (shapes, dtypes and bytes, in structure order)."""
    sha = hashlib.blake2b(digest_size=8)
    leaves, spec = tree_flatten((inputs, targets))
    sha.update(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            value = leaf.detach().contiguous().cpu()
            sha.update(f"{tuple(value.shape)}{value.dtype}".encode())
            sha.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        else:
            sha.update(repr(leaf).encode())
    return int.from_bytes(sha.digest(), "little") >> 1


def check_same_batch(step: int, batch_size: int, inputs: Any, targets: Any, device: torch.device,
                     wait: Callable[[Any, str], None]) -> None:
    """ValueError on every rank when `task.batch(step, batch_size)` gave the ranks different batches (one
    all-gather of a fingerprint over the job; `wait` bounds it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor([batch_fingerprint(inputs, targets)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(everyone, mine, async_op=True), "the batch fingerprint all-gather")
    values = [int(t.item()) for t in everyone]
    if len(set(values)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        split = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise ValueError(f"step {step}: task.batch({step}, {batch_size}) returned different batches on different "
                         f"ranks ({split} agree); batch() must return the same global batch on every rank: derive "
                         "its randomness from the step, not from the process")


def checks_batch(mode: str, step: int, start: int) -> bool:
    """Whether `step` compares the batch fingerprint under TrainConfig.batch_check `mode`."""
    return mode == "every" or (mode == "first" and step == start)
