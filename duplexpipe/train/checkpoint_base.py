"""What checkpoint code shares: the pipeline it reads (a Protocol, so no import of the trainer), this rank's stage
modules, RNG state, trainer counters and checks."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from duplexpipe.model.split import Partition
from duplexpipe.parallel import DPStrategy, ParallelGroups
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.checkpoint_reader import read_metadata_file
from duplexpipe.train.pipeline_config import PipelineConfig
from duplexpipe.train.planning.choice import AutoChoice
from duplexpipe.train.precision import DynamicLossScaler


class Checkpointable(Protocol):
    """What a checkpoint reads and restores of a training pipeline (a `Pipeline` is one)."""

    config: PipelineConfig
    schedule: Schedule
    groups: ParallelGroups
    dp: DPStrategy
    auto: AutoChoice | None
    partition: Partition | None
    scaler: DynamicLossScaler
    scheduler: Any
    device: torch.device
    calls: int
    optimizer_steps: int

    @property
    def window_calls(self) -> int: ...

    @property
    def stage_state_modules(self) -> dict[int, nn.Module]: ...

    def bounded(self, work: Any, what: str) -> None: ...


def stage_dict(pipe: Checkpointable) -> nn.ModuleDict:
    """This rank's stage modules keyed `stage<s>` (unwrapped): the form the strategies' checkpoint dicts take."""
    return nn.ModuleDict({f"stage{s}": m for s, m in sorted(pipe.stage_state_modules.items())})


def set_trainer_state(pipe: Checkpointable, meta: dict[str, Any]) -> None:
    """Restore the counters, loss scaler and LR scheduler from a loaded `trainer_state`."""
    if meta["fresh_optimizer"]:
        pipe.dp.optimizer.state.clear()
    pipe.calls = int(meta["calls"])
    pipe.optimizer_steps = int(meta["optimizer_steps"])
    pipe.scaler.load_state_dict(meta["scaler"])
    if pipe.scheduler is not None:
        pipe.scheduler.load_state_dict(meta["scheduler"])


def read_metadata(path: str) -> Metadata:
    """The checkpoint's metadata, read without running code (`checkpoint_reader`); CheckpointError (a ValueError)
    when `path` is not a torch.distributed.checkpoint directory, is incomplete or corrupt, or is unsafe."""
    return read_metadata_file(path)


def check_scheduler(path: str, stored: dict[str, Any], has_scheduler: bool) -> None:
    """Raise ValueError when the checkpoint and the pipeline disagree on having an LR scheduler."""
    saved = any(k.startswith("trainer.scheduler.") for k in stored)
    if saved != has_scheduler:
        has, lacks = ("the checkpoint", "this Pipeline") if saved else ("this Pipeline", "the checkpoint")
        raise ValueError(f"{has} has an LR scheduler but {lacks} has none ({path}); build the Pipeline with "
                         "the same scheduler= as the run that saved it")


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random-number generators, keyed by its global rank (unique across ranks, so each
    rank saves and restores its own): the torch CPU generator and every CUDA device's generator."""
    prefix = f"rank{rank()}"
    state = {f"{prefix}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"{prefix}.cuda{index}"] = cuda_state
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned (after loading it from a checkpoint)."""
    prefix = f"rank{rank()}"
    torch.set_rng_state(state[f"{prefix}.cpu"])
    devices = sorted(int(k.rsplit("cuda", 1)[1]) for k in state if k.startswith(f"{prefix}.cuda"))
    cuda = [state[f"{prefix}.cuda{index}"] for index in devices]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Hide torch's FutureWarning about ShardedTensor: ZeRO-1 stores its flat shards' pieces as ShardedTensor
    boxes (a DTensor cannot describe them), which torch.distributed.checkpoint still reads and writes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def check_between_windows(pipe: Checkpointable, verb: str) -> None:
    """Raise ValueError inside an accumulation window (the gradients of its calls are not in the checkpoint)."""
    if pipe.window_calls:
        raise ValueError(
            f"cannot {verb} a checkpoint inside an accumulation window ({pipe.window_calls} of "
            f"{pipe.config.accumulation_steps} calls done); {verb} after the optimizer step"
        )
