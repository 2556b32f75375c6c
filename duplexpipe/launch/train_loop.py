"""Ready-made training runs of a task (model + data) on local processes or torchrun; `duplexpipe train`."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.errors import CheckpointError, EveryStepSkipped, InputRejected
from duplexpipe.files import write_atomic
from duplexpipe.launch.batches import batch_rows, evaluate_batches, local_slice, rows_of
from duplexpipe.launch.checkpoints import LATEST, checkpoint_to_load, discard_partial, publish, resume_from, step_name
from duplexpipe.launch.folder_lock import FolderLock, hold_folders, job_folders
from duplexpipe.launch.job_guards import check_same_batch, checks_batch, locked_by_rank0
from duplexpipe.launch.metrics import MetricsLog, log_line, open_metrics, plain_every, progress_bar
from duplexpipe.launch.processes import launched_by_torchrun, run
from duplexpipe.launch.resume import RESUME_AUTO, intact_checkpoint
from duplexpipe.launch.step_profiler import StepProfiler
from duplexpipe.launch.train_config import DEFAULT_TASK, TrainConfig, lr_factor
from duplexpipe.launch.train_task import TrainTask, build_task, load_task
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.runtime.backend import default_device
from duplexpipe.runtime.memory import MemoryReport
from duplexpipe.schedules.timeline import Timeline
from duplexpipe.tp.plans import TPPlan
from duplexpipe.train.pipeline_config import AUTO
from duplexpipe.train.trainer import Pipeline

__all__ = ["DEFAULT_TASK", "LATEST", "TrainConfig", "TrainResult", "TrainTask", "checkpoint_to_load", "load_task",
           "run_training"]


@dataclass
class TrainResult:
    """What a training run produced (on rank 0 of the run)."""

    losses: list[float]
    """Mean loss of every (optimizer) step this run took, over the samples of its accumulation window."""
    items_per_s: float
    """Throughput after this run's first (warm-up) step, in the task's items (tokens for the GPT)."""
    timeline: Timeline | None
    """The last step's measured timeline, gathered from all pipeline ranks (dp replica 0)."""
    partition: str
    """The partition report."""
    wall_s: float
    """Seconds the training loop took on rank 0."""
    config: TrainConfig
    """The configuration that ran."""
    start_step: int = 0
    """Steps already done when this run started (from `resume`)."""
    send_bytes: float = 0.0
    """Rank 0's mean payload bytes per stage-to-stage SEND on the wire (`Pipeline.p2p_meter`; 0: it sent none)."""
    schedule: str = ""
    """The schedule that ran (schedule "auto": the planner's choice)."""
    plan: str = ""
    """What ran (`Pipeline.plan`); with schedule "auto" the planner's choice and its best candidates."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean held-out loss) of every evaluation this run made (`eval_every`)."""
    item_name: str = "samples"
    """What the throughput counts (the task's `item_name`)."""
    memory: list[MemoryReport] = field(default_factory=list)
    """The last step's measured memory of every pipeline rank (dp replica 0), in rank order; empty unless
    `observe.measure_memory` was on."""
    zero_stage: int = 0
    """The ZeRO stage that ran (schedule "auto": the planner's choice)."""

    @property
    def tokens_per_s(self) -> float:
        """Alias of items_per_s for token-level tasks."""
        return self.items_per_s


def make_optimizer(config: TrainConfig) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer factory of `config` (AdamW or SGD with momentum)."""
    opt = config.optimizer

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if opt.name == "sgd":
            return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
        return torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
    return factory


def make_scheduler(config: TrainConfig) -> Callable[[torch.optim.Optimizer], Any]:
    """The LR scheduler factory of `config` (warm-up, then constant / cosine / linear decay over the run's `steps`
    optimizer steps)."""
    opt = config.optimizer
    factor = lr_factor(opt.lr_schedule, opt.warmup, config.steps, opt.min_lr_ratio)
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _build_pipeline(config: TrainConfig, task: TrainTask) -> Pipeline:
    device_type = default_device().type
    mesh = make_mesh(config.ranks, config.dp, device_type, tp=config.tp, ep=config.ep) \
        if config.dp * config.tp > 1 else None
    pcfg = config.pipeline
    inputs, targets = task.batch(0, config.batch_size)
    dp_rank = dist.get_rank() // config.tp % config.dp  # make_mesh: rank = (pp index x dp + dp index) x tp + tp index
    auto = pcfg.schedule == AUTO
    sample = {"sample_input": local_slice(inputs, dp_rank, config.dp),
              "sample_targets": local_slice(targets, dp_rank, config.dp)} if auto else {}
    if task.pretrained is not None:
        if config.balance != "uniform":
            raise ValueError(f"balance {config.balance!r}: a Hugging Face model's layers are spread evenly "
                             "(balance 'uniform')")
        return Pipeline.from_pretrained(task.pretrained, make_optimizer(config), pcfg, mesh=mesh, dtype=task.dtype,
                                        scheduler=make_scheduler(config),
                                        router_bias_update_speed=task.router_bias_update_speed, **sample)
    if not auto:  # one microbatch of step 0's batch: the profiling sample of balance="time" (a tensor input)
        microbatches = config.schedule_object().num_microbatches
        first = rows_of(inputs, 0, max(1, batch_rows(inputs) // (microbatches * config.dp)))
        sample = {"sample_input": first} if isinstance(first, torch.Tensor) or config.balance == "time" else {}
    return Pipeline.from_layers(task.layers, task.loss_fn, make_optimizer(config), pcfg, embedding=task.embedding,
                                head=task.head, balance=config.balance, mesh=mesh, init=task.init,
                                scheduler=make_scheduler(config), tp_plan=task_tp_plan(task, config), **sample)


def task_tp_plan(task: TrainTask, config: TrainConfig) -> TPPlan | None:
    """The tensor-parallel plan a run of `task` uses (None with tp=1); ValueError when the task has none."""
    if config.tp == 1:
        return None
    if task.tp_plan is None:
        raise ValueError(f"--tp {config.tp}: task {config.task!r} has no tensor-parallel plan (TrainTask.tp_plan)")
    return task.tp_plan(config.pipeline.sequence_parallel)


def _save(pipe: Pipeline, config: TrainConfig, step: int) -> None:
    """Save checkpoint `step`; then rank 0 names it the latest. torch.distributed.checkpoint returns on rank 0
    only after every rank's files and the metadata are written, so `latest` never names a partial checkpoint."""
    assert config.checkpoint.save is not None
    name = step_name(step)
    try:
        pipe.save(str(Path(config.checkpoint.save) / name))
    except CheckpointError:  # every rank: the partial folder goes (a full disk stays full otherwise)
        if dist.get_rank() == 0:
            discard_partial(config.checkpoint.save, name)
        raise
    if dist.get_rank() == 0:
        publish(config.checkpoint.save, name, config.checkpoint.keep)


def _prepare(config: TrainConfig) -> tuple[TrainTask, Pipeline]:
    """The task and its pipeline, resumed from the checkpoint `config` names; ValueError for a bad input."""
    if dist.get_world_size() != config.ranks * config.dp * config.tp:
        raise ValueError(f"{dist.get_world_size()} processes, but ranks x dp x tp = {config.ranks} x {config.dp} x "
                         f"{config.tp}")
    torch.manual_seed(config.seed)
    task = build_task(config)
    if config.checkpoint.save_pretrained is not None and task.pretrained is None:
        raise ValueError(f"--save-pretrained writes a Hugging Face model; task {config.task!r} trains no "
                         "Hugging Face model (use --task hf)")
    if config.metrics.eval_every and task.eval_batch is None:
        raise ValueError(f"--eval-every {config.metrics.eval_every}: task {config.task!r} holds out no data (its "
                         "TrainTask has no eval_batch)")
    auto = config.checkpoint.resume in (None, RESUME_AUTO) and config.checkpoint.save is not None
    checkpoint = None if auto else resume_from(config.checkpoint.resume, config.checkpoint.save)
    pipe = _build_pipeline(config, task)
    if auto:  # the newest intact checkpoint, past damaged ones (named, set aside)
        checkpoint = intact_checkpoint(str(config.checkpoint.save))
    if checkpoint is not None:
        with warnings.catch_warnings(record=dist.get_rank() == 0) as caught:  # rank 0 reports them, one line each
            pipe.load(checkpoint)
        check_resumed_optimizer(pipe.optimizer, config, checkpoint)
        if dist.get_rank() == 0:
            print(f"resuming from step {steps_done(pipe)} of {checkpoint}", flush=True)
            for warning in caught or ():  # a layout change (what it reset), a checkpoint without a manifest, ...
                print(f"warning: {warning.message}", flush=True)
    if steps_done(pipe) >= config.steps:
        raise ValueError(f"the checkpoint is at step {steps_done(pipe)}; --steps {config.steps} leaves nothing to do")
    return task, pipe


def check_resumed_optimizer(optimizer: torch.optim.Optimizer, config: TrainConfig, checkpoint: Any) -> None:
    """ValueError when `config`'s optimizer settings differ from those a resumed optimizer took over from its
    checkpoint (its param groups' lr, weight decay and momentum win): a run that records --lr 0.5 while it trains
    with the checkpoint's lr is refused rather than silently mislabelled."""
    opt = config.optimizer
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    wanted = {"lr": ("initial_lr" if "initial_lr" in group else "lr", opt.lr, "--lr"),
              "weight_decay": ("weight_decay", opt.weight_decay, "--weight-decay")}
    if opt.name == "sgd":
        wanted["momentum"] = ("momentum", opt.momentum, "--momentum")
    for key, given, flag in wanted.values():
        saved = group.get(key)
        if isinstance(saved, (int, float)) and not math.isclose(saved, given, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(f"{flag} {given:g}, but the checkpoint {checkpoint} was trained with {saved:g}: a resumed "
                             f"run continues with the checkpoint's optimizer settings, so {flag} is not applied; give "
                             f"{flag} {saved:g} (or start a fresh run with --resume none)")


def steps_done(pipe: Pipeline) -> int:
    """The run's steps `pipe` has made: its calls over `accumulation_steps` (a checkpoint is never inside a window)."""
    return pipe.calls // pipe.config.accumulation_steps


def _train_rank(config: TrainConfig, lock_here: bool = False) -> TrainResult | None:
    """One rank of `run_training` (the default process group is initialised); `lock_here` (under torchrun): rank 0
    holds the run's folder locks (the local launcher holds them otherwise)."""
    with locked_by_rank0(config) if lock_here else contextlib.nullcontext():
        return _train(config)


def _train(config: TrainConfig) -> TrainResult | None:
    from duplexpipe.runtime import gather_timeline

    try:
        task, pipe = _prepare(config)
    except ValueError as exc:  # before the first step: the input, not the training, is wrong
        raise InputRejected(str(exc)) from exc
    start = steps_done(pipe)
    lead = dist.get_rank() == 0
    metrics = open_metrics(config, start) if lead else None
    try:
        losses, evals, rate, wall = _loop(pipe, task, config, start, metrics, lead)
    finally:
        if metrics is not None:
            metrics.close()
    if config.checkpoint.save_pretrained is not None:
        pipe.save_pretrained(config.checkpoint.save_pretrained, config.checkpoint.save_pretrained_overwrite)
    last = pipe.last.timeline if pipe.last is not None else None
    timeline = gather_timeline(last, group=pipe.groups.pp_group) if last is not None else None
    memory = gather_memory(pipe)
    if not lead:
        return None
    partition = str(pipe.partition) if pipe.partition is not None else ""
    sends = pipe.p2p_meter.calls.get("send", 0)
    send_bytes = pipe.p2p_meter.bytes.get("send", 0.0) / sends if sends else 0.0
    plan = pipe.plan.summary() if pipe.auto is None else f"{pipe.auto.summary()}\n{pipe.auto.result.table(5)}"
    return TrainResult(losses, rate, timeline, partition, wall, config, start, send_bytes, pipe.schedule.name, plan,
                       evals, task.item_name, memory, pipe.plan.zero_stage)


def gather_memory(pipe: Pipeline) -> list[MemoryReport]:
    """Every pipeline rank's measured memory of the last step, in rank order (collective over the pipeline group
    when measured; empty, without a collective, when not)."""
    if not pipe.config.observe.measure_memory or pipe.last is None or pipe.last.memory is None:
        return []
    reports: list[Any] = [None] * dist.get_world_size(pipe.groups.pp_group)
    dist.all_gather_object(reports, pipe.last.memory, group=pipe.groups.pp_group)
    return [r for r in reports if r is not None]


def _loop(pipe: Pipeline, task: TrainTask, config: TrainConfig, start: int, metrics: MetricsLog | None,
          lead: bool) -> tuple[list[float], list[tuple[int, float]], float, float]:
    """Train steps start..config.steps-1; returns (losses, (step, eval loss) pairs, items/s, wall seconds).

    items/s counts the steps after the first (warm-up) one, over the time spent fetching their batches
    and stepping (not logging, evaluating or saving checkpoints).
    """
    metrics_cfg = config.metrics
    bar = progress_bar(config.steps, start, task.item_name, sys.stdout) if config.metrics.progress and lead else None
    every = plain_every(config.metrics.log_every, config.steps, config.metrics.progress)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    compiling = CompileLines(dist.get_rank(), lead)
    pipe.compiled.report_to(compiling)
    profiler = StepProfiler(metrics_cfg.profile_steps, metrics_cfg.out_dir, dist.get_rank())
    began = time.perf_counter()
    items, busy = 0, 0.0  # after the first step: items trained and seconds spent fetching + stepping
    applied, skipped = 0, 0  # optimizer steps this run took, and skipped
    for step in range(start, config.steps):
        compiling.step = step + 1
        tick = time.perf_counter()
        lr = pipe.optimizer.param_groups[0]["lr"]
        profiler.before(step + 1)
        try:
            loss, step_items = _optimizer_step(pipe, task, config, step, start)
        except BaseException:
            profiler.close()
            raise
        traced = profiler.after(step + 1)
        if traced is not None and lead:
            print(f"torch.profiler trace of steps {metrics_cfg.profile_steps}: {traced} (one per rank)", flush=True)
        losses.append(loss)
        now = time.perf_counter()
        if step > start:
            items, busy = items + step_items, busy + (now - tick)
        values = _step_values(pipe, config, step + 1, lead,
                              {"loss": loss, "lr": lr, "items_per_s": step_items / (now - tick)})
        if pipe.last is not None:
            applied, skipped = applied + pipe.last.applied, skipped + pipe.last.skipped
        if config.metrics.eval_every and ((step + 1) % config.metrics.eval_every == 0 or step + 1 == config.steps):
            assert task.eval_batch is not None  # _prepare checked it
            values["eval_loss"] = evaluate_batches(pipe, task.eval_batch, config.batch_size, metrics_cfg.eval_batches)
            evals.append((step + 1, values["eval_loss"]))
        if metrics is not None:
            metrics.write(step + 1, values)
        if bar is not None:
            bar.update(step + 1, losses[-1], items / busy if busy else 0.0)
        elif lead and ((every and ((step + 1) % every == 0 or step + 1 == config.steps)) or "eval_loss" in values):
            print(log_line(step + 1, config.steps, values, task.item_name), flush=True)
        saving = config.checkpoint
        if saving.save and ((saving.save_every and (step + 1) % saving.save_every == 0) or step + 1 == config.steps):
            _save(pipe, config, step + 1)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    if skipped and not applied:
        raise EveryStepSkipped(f"every optimizer step of steps {start + 1}-{config.steps} was skipped: the gradients "
                               "held NaN or inf each time, so nothing was trained; check the weights and the inputs "
                               "for NaN or inf (and under fp16 the loss scale settings)")
    return losses, evals, items / busy if busy else 0.0, end - began


def _step_values(pipe: Pipeline, config: TrainConfig, step: int, lead: bool, values: dict[str, Any]) -> dict[str, Any]:
    """`values` with what the pipeline measured of step `step` (1-based): gradient norm, bubble, saved and peak
    bytes, a skip (said in one line); the step's timeline written when `timeline_every` asks for it."""
    from duplexpipe.runtime import gather_timeline

    metrics_cfg = config.metrics
    timeline = pipe.last.timeline if pipe.last is not None else None
    bubble = step_bubble(timeline, pipe.groups.pp_group, pipe.device, pipe.bounded) if timeline else None
    every_n = metrics_cfg.timeline_every
    if timeline and every_n and metrics_cfg.out_dir and step % every_n == 0:  # asked for: a pickled gather
        _write_timeline(gather_timeline(timeline, group=pipe.groups.pp_group), metrics_cfg.out_dir, step, lead)
    values = {**values, "grad_norm": pipe.last.grad_norm if pipe.last else None, "bubble": bubble}
    if pipe.last is not None and pipe.last.peak_saved_bytes:
        values["peak_saved_bytes"] = pipe.last.peak_saved_bytes
    if pipe.last is not None and pipe.last.memory is not None:  # this rank's (rank 0 writes the metrics)
        values["peak_memory_bytes"] = pipe.last.memory.total_peak
    if pipe.last is not None and pipe.last.skipped:  # NaN/inf gradients (fp16 overflow or nonfinite_grads "skip")
        values["skipped"] = True
        if lead:
            scale = f", fp16 loss scale now {pipe.scaler.scale:g}" if pipe.scaler.enabled else ""
            print(f"step {step}/{config.steps} skipped: its gradients held NaN or inf (norm "
                  f"{pipe.last.grad_norm}{scale}); {pipe.skipped_steps} skipped so far", flush=True)
    return values


class CompileLines:
    """Prints what compiled (`CompiledStages.report_to`): rank 0 the first step's and the first evaluation's lines,
    every rank its recompilations (marked with its rank), each step named by the run's count (`step`)."""

    def __init__(self, rank: int, lead: bool) -> None:
        self.rank, self.lead = rank, lead
        self.step = 0
        """The run's step in progress (1-based)."""

    def __call__(self, what: str, text: str, routine: bool) -> None:
        if routine and not self.lead:
            return
        label = f"step {self.step}" if what.startswith("step") else f"step {self.step} {what}" if what else ""
        print(f"{'' if self.lead else f'rank {self.rank}: '}{label}{text}", flush=True)


def _optimizer_step(pipe: Pipeline, task: TrainTask, config: TrainConfig, step: int, start: int) -> tuple[float, int]:
    """Optimizer step `step` (0-based): `accumulation_steps` calls of the pipeline, on the task's batches
    step x A .. step x A + A - 1; returns (the mean loss over the window's samples, items trained)."""
    calls = config.pipeline.accumulation_steps
    total, items = 0.0, 0
    for index in range(step * calls, (step + 1) * calls):
        x, y = task.batch(index, config.batch_size)
        if checks_batch(config.batch_check, index, start * calls):
            _check_batch(pipe, config, index, start * calls, x, y)
        x, y = (local_slice(v, pipe.groups.dp_rank, pipe.groups.dp_size) for v in (x, y))
        rows = batch_rows(x) * pipe.groups.dp_size
        total += pipe.step(x, y) * rows  # each call's loss is the mean over its samples
        items += rows * task.items_per_sample
    return total / (items / task.items_per_sample), items


def step_bubble(timeline: Timeline, group: Any, device: torch.device, wait: Callable[[Any, str], None]) -> float:
    """The step's bubble over the pipeline group (idle over ranks x makespan, `Timeline.bubble_ratio` of the gathered
    timelines) from one all-gather of three numbers per rank (first start, last end, busy seconds): no timeline
    travels. Collective over `group`: call it on every rank; `wait(work, what)` waits for the posted all-gather."""
    ranks = {e.rank for e in timeline.events}
    busy = sum(timeline.busy(r) for r in ranks)
    first = min((e.start for e in timeline.events), default=math.inf)
    last = max((e.end for e in timeline.events), default=-math.inf)
    mine = torch.tensor([first, last, busy], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(everyone, mine, group=group, async_op=True), "the bubble figure")
    table = torch.stack(everyone).cpu()
    span = float(table[:, 1].max() - table[:, 0].min())
    if not span > 0:
        return 0.0
    return 1.0 - float(table[:, 2].sum()) / (timeline.num_ranks * span)


def _write_timeline(timeline: Timeline, out_dir: str, step: int, lead: bool) -> None:
    """Rank 0 writes a gathered timeline to out_dir/timelines/step-NNNNNN.json (`MetricsConfig.timeline_every`)."""
    if not lead:
        return
    folder = Path(out_dir) / "timelines"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"{step_name(step)}.json", json.dumps(timeline.to_dict()) + "\n")


def _check_batch(pipe: Pipeline, config: TrainConfig, step: int, start: int, x: Any, y: Any) -> None:
    """The batch fingerprint compared across ranks; a mismatch on the run's first step is bad input (exit 2)."""
    try:
        check_same_batch(step, config.batch_size, x, y, pipe.device, pipe.bounded)
    except ValueError as exc:
        if step == start:
            raise InputRejected(str(exc)) from exc
        raise


def write_outputs(result: TrainResult, out_dir: str) -> None:
    """losses.json, timeline.json, partition.txt and (measured) memory.json in `out_dir`."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    summary = {"losses": result.losses, "start_step": result.start_step, "items_per_s": result.items_per_s,
               "wall_s": result.wall_s, "config": result.config.to_dict()}
    write_atomic(path / "losses.json", json.dumps(summary, indent=1) + "\n")
    if result.timeline is not None:
        write_atomic(path / "timeline.json", json.dumps(result.timeline.to_dict()) + "\n")
    if result.memory:
        write_atomic(path / "memory.json", json.dumps([m.to_dict() for m in result.memory]) + "\n")
    write_atomic(path / "partition.txt", result.partition + "\n")


def _comm_timeout_s(config: TrainConfig) -> float:
    """The process group's bound on a collective: the runtime's own, or its compile bound when stages compile (the
    runtime's watchdog applies each where it belongs; a shorter group bound would cut a compiling first step)."""
    safety = config.pipeline.safety
    return max(safety.timeout_s, safety.compile_timeout_s) if config.pipeline.compile else safety.timeout_s


def run_training(config: TrainConfig) -> TrainResult:
    """Train `config.task` on ranks * dp local processes (or in place under torchrun); rank 0's result.

    Under torchrun, non-zero ranks get a TrainResult with empty losses. The save and output folders are locked for
    the run (by this process, or under torchrun by rank 0): a second run on one of them is refused with
    FolderInUseError (a ValueError) naming the holder.
    """
    in_place = launched_by_torchrun()
    holding: contextlib.AbstractContextManager[list[FolderLock]] = (
        contextlib.nullcontext([]) if in_place else hold_folders(job_folders(config)))
    with holding as locks:
        def started(pids: list[int]) -> None:
            for lock in locks:
                lock.record_ranks(pids)

        results = run(_train_rank, config.ranks * config.dp * config.tp, (config, in_place), timeout_s=None,
                      comm_timeout_s=_comm_timeout_s(config), started=started)
        result = results[0]
        if result is None:
            return TrainResult([], 0.0, None, "", 0.0, config)
        if config.metrics.out_dir:
            write_outputs(result, config.metrics.out_dir)
    return result
