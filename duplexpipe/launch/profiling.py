"""`duplexpipe profile`: a task's model parts (its layers split, or a Hugging Face model's) measured into a planner
profile on this process, or with `calibrate` on local ranks that also measure the runtime inside a running pipeline,
exactly as schedule="auto" measures before it plans."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from duplexpipe.launch.processes import run
from duplexpipe.launch.train_config import TrainConfig
from duplexpipe.launch.train_loop import make_optimizer
from duplexpipe.launch.train_task import TrainTask, build_task
from duplexpipe.model.split import split_model
from duplexpipe.model.stages import PartInit, materialize_part
from duplexpipe.planner.profile import Profile
from duplexpipe.tp.plans import TPPlan
from duplexpipe.train.pipeline_config import AUTO, LossFn, PipelineConfig


@dataclass(frozen=True)
class ProfileRequest:
    """What `duplexpipe profile` measures, and how."""

    task: str
    """The task ("module:function", "file.py:function" or a bundled task's alias)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """The task function's keyword arguments."""
    parts: int = 8
    """Model parts to measure."""
    balance: str = "uniform"
    """How a task's layers are split ("uniform", "params", "time"); a Hugging Face model's are spread evenly."""
    microbatch: int = 4
    """Samples in the profiled microbatch (without `calibrate`)."""
    repeats: int = 3
    """Measured runs per part (the fastest counts)."""
    evict_bytes: int | None = None
    """Bytes written before each timed pass (None: 0 on one process; with `calibrate`, what schedule="auto" takes)."""
    calibrate: bool = False
    """Also train the parts on `ranks` local processes (`train.planning.measure`): the runtime's work per action,
    message and step, the in-pipeline compute scale, the calibration runs' wall times and the stage-to-stage link."""
    ranks: int = 2
    """Pipeline ranks of the calibration."""
    batch: int = 32
    """Samples per step of the calibration (profiled at its largest candidate microbatch, affine in the rows)."""
    budget_s: float = 3.0
    """Seconds of measured calibration steps."""
    seed: int = 0
    """The task's seed."""


def task_parts(task: TrainTask, num_parts: int, balance: str) -> tuple[list[nn.Module], PartInit | None, LossFn]:
    """The task's model in `num_parts` parts, the init that fills parts built on the meta device, and the loss: a
    Hugging Face model's parts (read from its directory) or the task's layers split by `balance`. ValueError naming
    the task's layer count when it has too few."""
    if task.pretrained is not None:
        from duplexpipe.model.hf import causal_lm_loss
        from duplexpipe.train.pretrained import PretrainedModel

        if balance != "uniform":
            raise ValueError(f"--balance {balance}: a Hugging Face model's layers are spread evenly (uniform)")
        source = PretrainedModel.open(task.pretrained, task.dtype)
        if source.num_layers < num_parts:
            raise ValueError(f"{task.pretrained} has {source.num_layers} decoder layers: fewer than --parts "
                             f"{num_parts} parts of at least one layer each")
        return list(source.parts(num_parts, None)), source.fill, causal_lm_loss
    parts, _ = split_model(task.layers, num_parts, balance, embedding=task.embedding, head=task.head)  # type: ignore[arg-type]
    return list(parts), task.init, task.loss_fn


def _task(request: ProfileRequest) -> TrainTask:
    return build_task(TrainConfig(task=request.task, task_options=dict(request.task_options), seed=request.seed))


def _meta(request: ProfileRequest) -> dict[str, Any]:
    meta: dict[str, Any] = {"task": request.task, "parts": request.parts, "balance": request.balance,
                            "threads": torch.get_num_threads()}
    if request.calibrate:
        meta["calibrated_on"] = {"ranks": request.ranks, "batch": request.batch}
    return meta


def profile_here(request: ProfileRequest) -> Profile:
    """The parts measured on this process, on the first `microbatch` samples of the task's step-0 batch."""
    from duplexpipe.train.planning.measure import profile_parts

    task = _task(request)
    parts, init, loss_fn = task_parts(task, request.parts, request.balance)
    inputs, targets = task.batch(0, request.microbatch)
    from duplexpipe.launch.batches import batch_rows

    if batch_rows(inputs) < request.microbatch:
        raise ValueError(f"--microbatch {request.microbatch}: the task's batch(0, {request.microbatch}) gave only "
                         f"{batch_rows(inputs)} samples")
    modules = [materialize_part(parts, k, "cpu", init) if init is not None else parts[k] for k in range(len(parts))]
    return profile_parts(modules, inputs, target=targets, loss_fn=loss_fn, repeats=request.repeats,
                         evict_bytes=request.evict_bytes or 0, meta=_meta(request), tp_plan=_tp_plan(task, modules))


def _tp_plan(task: TrainTask, parts: list[nn.Module]) -> TPPlan | None:
    """The plan the planner prices T > 1 with: the task's, or a Hugging Face model's published one (None when the
    model has none, as GPT-2: it is then profiled without)."""
    if task.pretrained is None:
        return task.tp_plan(False) if task.tp_plan is not None else None
    from duplexpipe.model.hf_tp import HFTensorPlan

    plan = HFTensorPlan(sequence_parallel=False)
    try:
        for part in parts:
            plan.styles(part)
    except ValueError:
        return None
    return plan


def _calibrated_rank(request: ProfileRequest) -> dict[str, Any] | None:
    """One rank of `profile_calibrated`: rank 0's profile and the calibration every rank trains; rank 0 returns it."""
    import torch.distributed as dist

    from duplexpipe.parallel.mesh import ParallelGroups
    from duplexpipe.runtime.backend import default_device
    from duplexpipe.train.planning.auto import PlanSetup, measure

    task = _task(request)
    parts, init, loss_fn = task_parts(task, request.parts, request.balance)
    options: dict[str, Any] = {"calibration_cache": None, "calibration_budget_s": request.budget_s,
                               "repeats": request.repeats}
    if request.evict_bytes is not None:
        options["evict_bytes"] = request.evict_bytes
    config = PipelineConfig(schedule=AUTO, schedule_options=options)
    setup = PlanSetup(ParallelGroups.from_mesh(None), default_device(), init)
    profile, _, _ = measure(parts, loss_fn, make_optimizer(TrainConfig()), config, setup, task.batch(0, request.batch))
    if dist.get_rank() != 0:
        return None
    return replace(profile, meta={**profile.meta, **_meta(request)}).to_dict()


def profile_calibrated(request: ProfileRequest) -> Profile:
    """The profile schedule="auto" measures for `request.ranks` pipeline ranks and a batch of `request.batch`:
    rank 0's profile with the runtime's overhead and in-pipeline compute scale fitted from calibration runs on
    local processes (gloo on CPUs), their wall times and the measured link in its meta."""
    results = run(_calibrated_rank, request.ranks, (request,))
    return Profile.from_dict(results[0], "the calibrated profile")


def profile_task(request: ProfileRequest) -> Profile:
    """`profile_calibrated` with `request.calibrate`, else `profile_here`."""
    torch.manual_seed(request.seed)
    return profile_calibrated(request) if request.calibrate else profile_here(request)


__all__ = ["ProfileRequest", "profile_calibrated", "profile_here", "profile_task", "task_parts"]
