"""What `duplexpipe train` checks before it starts any process: every configuration error the ranks would
otherwise each find after seconds of start-up, as one ValueError (the command line prints it as one line and
exits with code 2)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from duplexpipe.comm import check_optimizer
from duplexpipe.dp_options.compression import compression_options
from duplexpipe.launch.processes import default_backend
from duplexpipe.launch.train_config import TrainConfig
from duplexpipe.launch.train_loop import make_optimizer, task_tp_plan
from duplexpipe.launch.train_task import TrainTask, build_task, load_task
from duplexpipe.moe.balance import moe_layers
from duplexpipe.parallel.compressed import check_dgc_momentum
from duplexpipe.parallel.zero_config import check_hpz
from duplexpipe.tp.plans import check_plan
from duplexpipe.train.float8 import check_float8, float8_options
from duplexpipe.train.pipeline_config import AUTO


def check_training(config: TrainConfig) -> None:
    """Raise ValueError (ScheduleError for the schedule) for the first thing in `config` the ranks would fail
    on: the schedule with its ranks and microbatches, the pipeline settings together (precision, sends,
    ZeRO with compression, ...), the optimizer against the gradient compression (DGC with momentum, a
    sparsifier under Adam), hpZ against the schedule, then the task: importable, buildable (on the meta
    device: no memory, no weights computed) and with enough layers for the schedule's model parts."""
    schedule = None if config.pipeline.schedule == AUTO else config.schedule_object()
    dp = config.pipeline.data_parallel  # PipelineConfig checked its fields against each other when it was built
    compression = compression_options(dp.grad_compression)
    if compression.method != "none":  # building an optimizer imports torch's dynamo (a second): only then
        optimizer = make_optimizer(config)([nn.Parameter(torch.zeros(1))])
        check_optimizer(compression, optimizer)
        check_dgc_momentum(compression, optimizer)
    if (float8 := float8_options(config.pipeline.precision.float8)) is not None:
        ranks = config.ranks * config.dp * config.tp
        check_float8(float8, torch.device("cuda", 0) if default_backend(ranks) == "nccl" else torch.device("cpu"))
    if schedule is not None and dp.zero_stage in (2, 3) and config.dp > 1:
        check_hpz(dp.zero, schedule, config.dp, dp.zero_stage)
    load_task(config.task)
    task = _built(config)
    if config.metrics.eval_every and task.eval_batch is None:
        raise ValueError(f"--eval-every {config.metrics.eval_every}: task {config.task!r} holds out no data (its "
                         "TrainTask has no eval_batch)")
    if task.pretrained is not None:
        parts = _check_pretrained(config, task, schedule.num_groups if schedule is not None else None)
        _check_supported(config, task, any(moe_layers(part) for part in parts))
    elif schedule is not None and len(task.layers) < schedule.num_groups:
        raise ValueError(f"task {config.task!r} has {len(task.layers)} layers, but schedule "
                         f"{config.pipeline.schedule!r} on {config.ranks} ranks runs {schedule.num_groups} model parts "
                         "of at least one layer each; use fewer ranks, another schedule or a deeper model")
    if task.pretrained is None:
        _check_supported(config, task, any(moe_layers(layer) for layer in task.layers))
    _check_tensor_parallel(config, task)


def _check_supported(config: TrainConfig, task: TrainTask, has_experts: bool) -> None:
    """Settings the task's model cannot use: expert parallelism without MoE layers, and the checkpoints ZeRO cannot
    write yet (ZeRO-1 under tensor parallelism, ZeRO with MoE experts held whole: ZeRO-1, ep 1 or ep = dp), refused
    before training rather than at the first save."""
    if config.ep > 1 and not has_experts:
        raise ValueError(f"--ep {config.ep}: task {config.task!r} has no MoE layers (expert parallelism spreads MoE "
                         "experts over the replicas); leave out --ep")
    zero = config.pipeline.data_parallel.zero_stage or 0
    if not config.checkpoint.save or not zero or config.dp == 1:
        return
    if zero == 1 and config.tp > 1:
        raise ValueError(f"--save with ZeRO-1 under tensor parallelism (--tp {config.tp}): its checkpoints are not "
                         "supported yet; save with --zero-stage 0 or 2")
    if has_experts and not (zero >= 2 and 1 < config.ep < config.dp):  # there the experts are FSDP's DTensors
        raise ValueError(f"--save with --zero-stage {zero} and MoE experts held whole (--ep {config.ep}, --dp "
                         f"{config.dp}): its checkpoints are not supported yet; save with --zero-stage 0, or with "
                         "--zero-stage 2 or 3 and an --ep below --dp (the experts sharded over their replicas)")


def _check_tensor_parallel(config: TrainConfig, task: TrainTask) -> None:
    """--tp > 1: the task's plan against the whole model (its layers named as `Pipeline.from_layers` names them:
    module paths, sharded dimensions and heads); a Hugging Face model is checked when its pipeline is built."""
    plan = task_tp_plan(task, config) if task.pretrained is None else None
    if plan is None:
        return
    named = ([("embedding", task.embedding)] if task.embedding is not None else []) + \
        [(f"layer{i}", layer) for i, layer in enumerate(task.layers)] + \
        ([("head", task.head)] if task.head is not None else [])
    check_plan([nn.Sequential(OrderedDict(named))], plan, config.tp)


def _check_pretrained(config: TrainConfig, task: TrainTask, num_parts: int | None) -> list[nn.Module]:
    """A Hugging Face model directory opened as every rank will open it (config, tensor names and shapes, on the
    meta device) and cut into the schedule's parts with the experts spread over `ep`: a missing tensor, too few
    layers or experts that ep does not divide are found here."""
    from duplexpipe.train.pretrained import PretrainedModel

    assert task.pretrained is not None
    source = PretrainedModel.open(task.pretrained, task.dtype)
    if num_parts is not None and source.num_layers < num_parts:
        raise ValueError(f"{task.pretrained} has {source.num_layers} decoder layers, but schedule "
                         f"{config.pipeline.schedule!r} on {config.ranks} ranks runs {num_parts} model parts of at "
                         "least one layer each; use fewer ranks or another schedule")
    return list(source.parts(num_parts or 1, experts=(0, config.ep), bias_update_speed=task.router_bias_update_speed))


def _built(config: TrainConfig) -> TrainTask:
    """The task, built on the meta device (no memory); on the CPU when it cannot be built there (a task that
    reads weights, say); ValueError naming the task when it cannot be built at all."""
    try:
        with torch.device("meta"), _NoFillsOnMeta():
            return build_task(config)
    except (ValueError, TypeError) as exc:  # its options or its result: the same on any device
        raise ValueError(f"task {config.task!r} with options {config.task_options}: {exc}") from exc
    except Exception:  # noqa: BLE001 - something the meta device cannot do: build it for real
        pass
    try:
        return build_task(config)
    except Exception as exc:
        raise ValueError(f"task {config.task!r} with options {config.task_options}: {type(exc).__name__}: "
                         f"{exc}") from exc


_FILLS = frozenset(f"{name}_" for name in ("normal", "uniform", "zero", "fill", "exponential", "bernoulli", "random",
                                           "geometric", "log_normal", "cauchy", "copy", "mul", "add", "sub", "div",
                                           "clamp", "masked_fill", "index_fill", "scatter"))
"""In-place tensor methods that change values, not shapes."""


class _NoFillsOnMeta(TorchFunctionMode):
    """Skips filling meta tensors (they hold no values): torch's meta kernels of the random fills go through
    torch's reference implementations, whose first call imports its dynamo (about a second)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = getattr(func, "__name__", "")
        fills = getattr(func, "__module__", "") == "torch.nn.init" or name in _FILLS
        if fills and isinstance(target, Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)
