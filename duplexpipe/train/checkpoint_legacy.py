"""Checkpoints of the stage-keyed format 1 (`model.stage<s>.<name>`): they load into the layout that saved them."""

from __future__ import annotations

import io
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from duplexpipe.train.checkpoint_base import (
    Checkpointable,
    check_scheduler,
    quiet_sharded_tensor,
    rank,
    rng_state,
    set_rng_state,
    set_trainer_state,
    stage_dict,
)
from duplexpipe.train.plain_state import WeightsOnlyLoadPlanner

_STAGE_KEY = re.compile(r"^model\.stage\d+\.")


def is_legacy(stored: dict[str, Any]) -> bool:
    """True for a format-1 checkpoint: stage-keyed model entries and no `trainer.format`."""
    return "trainer.format" not in stored and any(_STAGE_KEY.match(k) for k in stored)


def _any_rank(flag: bool, pipe: Checkpointable) -> bool:
    value = torch.tensor([int(flag)], dtype=torch.int64, device=pipe.device)
    if dist.is_available() and dist.is_initialized():  # every rank raises, none waits in dcp.load
        pipe.bounded(dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True), "the checkpoint key check")
    return bool(value.item())


def load_legacy(pipe: Checkpointable, path: str, stored: dict[str, Any]) -> None:
    """Load a format-1 checkpoint into the layout that saved it; ValueError (on every rank) saying how to convert it
    when this pipeline's layout differs."""
    modules = stage_dict(pipe)
    model_sd, optim_sd = pipe.dp.checkpoint_dicts(modules)
    rng = rng_state()
    missing = [k for k in [f"model.{k}" for k in model_sd] + [f"rng.{k}" for k in rng] if k not in stored]
    if _any_rank(bool(missing), pipe):
        raise ValueError(f"checkpoint {path} has the stage-keyed format of earlier duplexpipe versions, which loads "
                         "only into the schedule, ranks and split that saved it (this pipeline differs); to convert "
                         "it, load it into a Pipeline built like the saving one and save it again with pipe.save()")
    check_scheduler(path, stored, pipe.scheduler is not None)
    trainer = {"schedule": pipe.schedule.name, "num_stages": pipe.schedule.num_stages, "calls": 0,
               "optimizer_steps": 0, "fresh_optimizer": False, "scaler": pipe.scaler.state_dict()}
    if pipe.scheduler is not None:
        trainer["scheduler"] = pipe.scheduler.state_dict()
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "trainer": trainer, "rng": rng}
    blob = f"dp.rank{rank()}"
    if blob in stored:
        state["dp"] = {f"rank{rank()}": b""}
    with quiet_sharded_tensor():
        dcp.load(state, checkpoint_id=path, planner=WeightsOnlyLoadPlanner())
    set_rng_state(state["rng"])
    if blob in stored:
        pipe.dp.load_state_dict(torch.load(io.BytesIO(state["dp"][f"rank{rank()}"]), weights_only=True))
    pipe.dp.load_checkpoint_dicts(modules, state["model"], state["optim"])
    set_trainer_state(pipe, state["trainer"])
