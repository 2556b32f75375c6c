"""Checkpoint and resume a Pipeline with torch.distributed.checkpoint (parts, optimizer, LR scheduler, RNG and
data-parallel strategy state per rank)."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

if TYPE_CHECKING:
    from duplexpipe.train.trainer import Pipeline


def stage_dict(pipe: Pipeline) -> nn.ModuleDict:
    """This rank's stage modules keyed `stage<s>` (unwrapped), so every key names its stage.

    Keys are unique across pipeline ranks and equal across data-parallel replicas, which
    torch.distributed.checkpoint then stores once.
    """
    return nn.ModuleDict({f"stage{s}": m for s, m in sorted(pipe.stage_state_modules.items())})


def trainer_state(pipe: Pipeline, fresh_optimizer: bool) -> dict[str, Any]:
    """The trainer's own counters (equal on every rank), and the LR scheduler's state when there is one."""
    state = {
        "schedule": pipe.schedule.name,
        "num_stages": pipe.schedule.num_stages,
        "calls": pipe.calls,
        "optimizer_steps": pipe.optimizer_steps,
        "fresh_optimizer": fresh_optimizer,
        "scaler": pipe.scaler.state_dict(),
    }
    if pipe.scheduler is not None:
        state["scheduler"] = pipe.scheduler.state_dict()
    return state


def _check_scheduler(path: str, pipe: Pipeline) -> None:
    """Raise ValueError (on every rank alike) when the checkpoint and the Pipeline disagree on having
    an LR scheduler."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = any(k.startswith("trainer.scheduler.") for k in stored)
    if saved != (pipe.scheduler is not None):
        has, lacks = ("the checkpoint", "this Pipeline") if saved else ("this Pipeline", "the checkpoint")
        raise ValueError(f"{has} has an LR scheduler but {lacks} has none ({path}); build the Pipeline with "
                         "the same scheduler= as the run that saved it")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random-number generators, keyed by its global rank (unique across ranks, so each
    rank saves and restores its own): the torch CPU generator and every CUDA device's generator."""
    prefix = f"rank{_rank()}"
    state = {f"{prefix}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"{prefix}.cuda{index}"] = cuda_state
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned (after loading it from a checkpoint)."""
    prefix = f"rank{_rank()}"
    torch.set_rng_state(state[f"{prefix}.cpu"])
    devices = sorted(int(k.rsplit("cuda", 1)[1]) for k in state if k.startswith(f"{prefix}.cuda"))
    cuda = [state[f"{prefix}.cuda{index}"] for index in devices]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def dp_state(pipe: Pipeline) -> dict[str, bytes]:
    """The data-parallel strategy's state (compression residuals, ...) keyed by this process's global rank
    (every rank's differs), serialized with torch.save; {} when the strategy keeps none."""
    state = pipe.dp.state_dict()
    if not state:
        return {}
    raw = io.BytesIO()
    torch.save(state, raw)
    return {f"rank{_rank()}": raw.getvalue()}


def set_dp_state(pipe: Pipeline, stored: dict[str, Any]) -> None:
    """Restore what `dp_state` returned (after loading it from a checkpoint)."""
    for raw in stored.values():
        pipe.dp.load_state_dict(torch.load(io.BytesIO(raw), weights_only=False))


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    """Hide torch's FutureWarning about ShardedTensor: ZeRO-1 stores its flat shards' pieces as ShardedTensor
    boxes (a DTensor cannot describe them), which torch.distributed.checkpoint still reads and writes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _check_between_windows(pipe: Pipeline, verb: str) -> None:
    if pipe.window_calls:
        raise ValueError(
            f"cannot {verb} a checkpoint inside an accumulation window ({pipe.window_calls} of "
            f"{pipe.config.accumulation_steps} calls done); {verb} after the optimizer step"
        )


def save_checkpoint(pipe: Pipeline, path: str) -> None:
    """Write model parts, optimizer state and trainer counters to directory `path` (all ranks call)."""
    _check_between_windows(pipe, "save")
    fresh = not pipe.optimizer.state
    modules = stage_dict(pipe)
    model_sd, optim_sd = pipe.dp.checkpoint_dicts(modules)
    if fresh:
        # checkpoint_dicts initialised the state with a zero-lr step; a fresh optimizer must stay fresh.
        pipe.optimizer.state.clear()
    state = {"model": model_sd, "optim": optim_sd, "trainer": trainer_state(pipe, fresh), "rng": rng_state()}
    extra = dp_state(pipe)
    if extra:
        state["dp"] = extra
    with _quiet_sharded_tensor():
        dcp.save(state, checkpoint_id=path)


def load_checkpoint(pipe: Pipeline, path: str) -> None:
    """Restore what `save_checkpoint` wrote into an identically configured Pipeline (all ranks call)."""
    _check_between_windows(pipe, "load")
    modules = stage_dict(pipe)
    rng = rng_state()
    extra = {k: b"" for k in dp_state(pipe)}
    _check_keys(pipe, path, [f"model.{k}" for k in modules.state_dict()] + [f"rng.{k}" for k in rng]
                + [f"dp.{k}" for k in extra])
    _check_scheduler(path, pipe)
    model_sd, optim_sd = pipe.dp.checkpoint_dicts(modules)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "trainer": trainer_state(pipe, False),
                             "rng": rng}
    if extra:
        state["dp"] = extra
    with _quiet_sharded_tensor():
        dcp.load(state, checkpoint_id=path)
    set_rng_state(state["rng"])
    if extra:
        set_dp_state(pipe, state["dp"])
    pipe.dp.load_checkpoint_dicts(modules, state["model"], state["optim"])
    meta = state["trainer"]
    if meta["fresh_optimizer"]:
        pipe.optimizer.state.clear()
    pipe.calls = int(meta["calls"])
    pipe.optimizer_steps = int(meta["optimizer_steps"])
    pipe.scaler.load_state_dict(meta["scaler"])
    if pipe.scheduler is not None:
        pipe.scheduler.load_state_dict(meta["scheduler"])


def _check_keys(pipe: Pipeline, path: str, keys: list[str]) -> None:
    """Raise ValueError naming this rank's model (and RNG) keys that the checkpoint lacks, on every rank."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [k for k in keys if k not in stored]
    anywhere = torch.tensor([len(missing)], dtype=torch.int64, device=pipe.device)
    if dist.is_available() and dist.is_initialized():  # every rank raises, none waits in dcp.load
        pipe.bounded(dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, async_op=True), "the checkpoint key check")
    if anywhere.item() and not missing:
        raise ValueError(f"checkpoint {path} does not match the pipeline on another rank")
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} of this rank's {len(keys)} tensors ({shown}); was it "
            "saved with another schedule, split, model or number of ranks?"
        )
