"""Training tasks that fail on purpose, for the tests of what a failed `duplexpipe train` prints."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from duplexpipe import TrainTask

WIDTH = 8


def _layers(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]


def _batch(step: int, size: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(size, WIDTH, generator=torch.Generator().manual_seed(step))
    return x, torch.sin(x)


def loss_fails(seed: int = 0) -> TrainTask:
    """The loss raises on the second step: only the last pipeline rank computes it."""
    calls = [0]

    def loss(out: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] > 2:  # 2 microbatches per step
            raise ValueError("bad value 42 in the loss")
        return nn.functional.mse_loss(out, target)

    return TrainTask(layers=_layers(seed), loss_fn=loss, batch=_batch)


def batch_fails(seed: int = 0) -> TrainTask:
    """The batch of step 1 raises: every rank fetches it, so every rank fails the same way."""

    def batch(step: int, size: int) -> tuple[Tensor, Tensor]:
        if step == 1:
            raise ValueError(f"bad value {size} in the batch")
        return _batch(step, size)

    return TrainTask(layers=_layers(seed), loss_fn=nn.functional.mse_loss, batch=batch)


def nan_grads(seed: int = 0) -> TrainTask:
    """The loss is NaN on the second step (its gradients too): the run must stop, naming the step."""
    calls = [0]

    def loss(out: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        value = nn.functional.mse_loss(out, target)
        return value * float("nan") if calls[0] in (3, 4) else value  # 2 microbatches per step

    return TrainTask(layers=_layers(seed), loss_fn=loss, batch=_batch)


def plain(seed: int = 0) -> TrainTask:
    """The layers and batches of the tasks above, with nothing wrong: what a run resumed after a fault trains."""
    return TrainTask(layers=_layers(seed), loss_fn=nn.functional.mse_loss, batch=_batch)


def nan_batch(seed: int = 0, at: int = 4) -> TrainTask:
    """`plain`, but the batch of step index `at` is NaN (its gradients too): the run stops naming that step."""

    def batch(step: int, size: int) -> tuple[Tensor, Tensor]:
        x, y = _batch(step, size)
        return (torch.full_like(x, float("nan")), y) if step == at else (x, y)

    return TrainTask(layers=_layers(seed), loss_fn=nn.functional.mse_loss, batch=batch)


def full_disk(seed: int = 0, at: str = "step-000004") -> TrainTask:
    """`plain`, but in this rank's process every checkpoint data file written into a folder named `at` fails as on a
    full disk (ENOSPC): the save of that step fails on every rank."""
    import contextlib
    import errno
    import os
    from pathlib import Path

    from duplexpipe.train.checkpoint.storage import NamingFileSystem

    original = NamingFileSystem.create_stream  # where the checkpoint writer opens its files

    @contextlib.contextmanager
    def create_stream(self: NamingFileSystem, path: object, mode: str):  # type: ignore[no-untyped-def]
        with original(self, path, mode) as stream:  # type: ignore[arg-type]
            if "w" in mode and Path(str(path)).parent.name == at and str(path).endswith(".distcp"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield stream

    NamingFileSystem.create_stream = create_stream  # type: ignore[method-assign]  # this rank process only
    return plain(seed)
