"""Calibrate the runtime's work per action, message and step, and the parts' in-pipeline compute scale."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks import harness
from benchmarks.internals import OverheadSample, PartProfile, RuntimeOverhead, rank_counts, rank_work, solve_overhead
from duplexpipe import Pipeline, PipelineConfig, Schedule, build_schedule, profile_parts

LossFn = Callable[[Any, Any], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
CpuTimer = Callable[[], float]
"""This process's CPU seconds (all its threads: gloo's included); time.process_time by default."""


class TinyPart(nn.Module):
    """A part with near-zero compute: the message times one scalar weight (so it has F, I and W)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        """x * scale."""
        return x * self.scale


def _loss(output: Tensor, target: Tensor) -> Tensor:
    return output.pow(2).mean()


def timed_steps(pipes: Sequence[Pipeline], batches: Sequence[tuple[Any, Any]], steps: int, warmup: int,
                cpu_timer: CpuTimer) -> tuple[list[float], list[float]]:
    """Round-robin steps, each between barriers: per pipe, this rank's median CPU seconds and the slowest rank's
    median wall seconds of the measured steps."""
    traces = harness.RoundRobin(list(zip(pipes, batches, strict=True)), lambda s, _: s[0].step(*s[1]),
                                cpu_timer=cpu_timer).run(steps, warmup)
    return [statistics.median(t.cpu) for t in traces], [statistics.median(t.wall) for t in traces]


def gathered_samples(runs: Sequence[tuple[Schedule, Sequence[PartProfile]]], cpu: Sequence[float]
                     ) -> list[OverheadSample]:
    """Every rank's sample of every run: its actions and messages in the run's schedule, its CPU seconds per step,
    and its parts' profiled compute (`rank_work` of the run's groups)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(cpu))
    return [OverheadSample(*rank_counts(schedule)[rank], took, rank_work(schedule, groups)[rank])
            for rank, seconds in enumerate(gathered) for (schedule, groups), took in zip(runs, seconds, strict=True)]


@dataclass(frozen=True)
class OverheadCalibration:
    """What `measure_overhead` measured and solved."""

    overhead: RuntimeOverhead  # the solved per-action, per-message and per-step work
    samples: tuple[OverheadSample, ...]
    """Every rank's sample at every M (median CPU seconds per step minus its tiny parts' compute)."""
    wall_s: dict[tuple[str, int], float]
    """(schedule, M) -> median wall seconds of the slowest rank's step (to check a prediction against)."""
    tiny: PartProfile | None = None
    """The 1-weight calibration's part on one message, measured alone on this rank in CPU time (each
    rank's own F + I + W, per action: F, fused B, I or W, is its samples' compute); None for real parts."""

    @property
    def tiny_s(self) -> float:
        """F + I + W of the tiny part (0 without one)."""
        return 0.0 if self.tiny is None else self.tiny.forward_s + self.tiny.backward_s


def measure_overhead(message: Tensor, *, runs: Sequence[tuple[str, int]] | None = None, steps: int = 10,
                     warmup: int = 2, config: PipelineConfig | None = None,
                     cpu_timer: CpuTimer = time.process_time) -> OverheadCalibration:
    """Run schedules over the P ranks of the default group with `TinyPart`s on messages like `message`
    (one microbatch's activation), measure each rank's CPU seconds per step and solve for the runtime's
    work per compute action, per SEND/RECV and per step (`schedules.overhead.solve_overhead`).

    Call on every rank. `runs`: (schedule, M) pairs (default 1F1B at M = P and 2P, and ZB-H1 at 2P:
    actions and messages per rank then vary independently, also at P = 2); their steps alternate,
    each timed between barriers, the median kept. A rank's sample is its CPU seconds minus its
    actions' cost in one tiny part's F, fused B, I and W (measured alone, in CPU time). `config` is the template
    for each `Pipeline` (its flags, e.g. `count_saved_bytes`, change what the runtime does;
    schedule and M are set here). Waiting in gloo takes no CPU time, so a rank's CPU time is its
    own work whatever the other ranks do.
    """
    if not dist.is_initialized():
        raise ValueError("measure_overhead runs on every rank of an initialized process group")
    ranks = dist.get_world_size()
    plan = list(runs) if runs is not None else [("1f1b", ranks), ("1f1b", 2 * ranks), ("zb-h1", 2 * ranks)]
    if steps < 1 or warmup < 0 or not plan or min(m for _, m in plan) < 1:
        raise ValueError(f"measure_overhead needs steps >= 1, warmup >= 0 and runs of M >= 1, got "
                         f"steps={steps}, warmup={warmup}, runs={plan}")
    tiny = profile_parts([TinyPart()], message, repeats=5, warmup=2, fit_rows=0, timer=cpu_timer).parts[0]
    base = config or PipelineConfig()
    pipes = [Pipeline([TinyPart() for _ in range(build_schedule(name, ranks, m).num_groups)], _loss,
                      lambda p: torch.optim.SGD(p, lr=0.0), replace(base, schedule=name, num_microbatches=m))
             for name, m in plan]
    batches = [(torch.cat([message.detach()] * m), torch.zeros(len(message) * m)) for _, m in plan]
    cpu, wall = timed_steps(pipes, batches, steps, warmup, cpu_timer)
    mine = (cpu, tiny)
    gathered: list[tuple[list[float], PartProfile] | None] = [None] * ranks
    dist.all_gather_object(gathered, mine)
    samples = []
    for r, got in enumerate(gathered):
        assert got is not None
        for (name, m), seconds in zip(plan, got[0], strict=True):
            schedule = build_schedule(name, ranks, m)
            actions, messages = rank_counts(schedule)[r]
            compute = rank_work(schedule, [got[1]] * schedule.num_groups)[r]
            samples.append(OverheadSample(actions, messages, seconds, compute))
    method = (f"{', '.join(f'{n} M={m}' for n, m in plan)} on {ranks} ranks with 1-weight parts on "
              f"{tuple(message.shape)} messages: median CPU time per rank of {steps} steps each, minus the "
              f"parts' own compute, least squares over {len(samples)} rank-runs")
    return OverheadCalibration(solve_overhead(samples, method), tuple(samples), dict(zip(plan, wall, strict=True)),
                               tiny)


@dataclass(frozen=True)
class CalibrationRun:
    """One schedule of the in-pipeline calibration, with the real parts."""

    schedule: Schedule  # what to run (over the P ranks of the default group)
    parts: Sequence[nn.Module]  # its model parts (one per group: the profiled parts merged as the planner groups them)
    groups: Sequence[PartProfile]
    """Their profile at this schedule's microbatch (what the rank's compute is charged from)."""


def measure_in_pipeline(runs: Sequence[CalibrationRun], batch: tuple[Tensor, Tensor], loss_fn: LossFn,
                        optimizer: OptimizerFactory, *, steps: int = 10, warmup: int = 2,
                        config: PipelineConfig | None = None,
                        cpu_timer: CpuTimer = time.process_time) -> OverheadCalibration:
    """Train `runs` (real parts, the whole `batch` per step, their steps alternating, each between
    barriers) and solve each rank's median CPU seconds per step as alpha x its profiled compute
    (`rank_work` of its groups) + per compute action + per SEND/RECV + per step work
    (`solve_overhead(fit_scale=True)`): alpha is the parts' in-pipeline CPU time over their profile
    (caches, preemption, gradient accumulation), the optimizer and clipping land in the per-step term.

    Call on every rank. `config`: the template of each `Pipeline` (schedule set here). The runs
    should differ in M and in fused vs split backward, and must not be the schedules being
    predicted; raises ValueError when the samples cannot separate the terms.
    """
    if not dist.is_initialized():
        raise ValueError("measure_in_pipeline runs on every rank of an initialized process group")
    ranks = dist.get_world_size()
    if steps < 1 or warmup < 0 or not runs:
        raise ValueError(f"measure_in_pipeline needs steps >= 1, warmup >= 0 and at least one run, got "
                         f"steps={steps}, warmup={warmup}, {len(runs)} runs")
    for run in runs:
        if run.schedule.num_ranks != ranks or len(run.parts) != run.schedule.num_groups:
            raise ValueError(f"calibration run {run.schedule.name!r} needs {ranks} ranks and one part per model "
                             f"part ({run.schedule.num_groups}), got {run.schedule.num_ranks} ranks and "
                             f"{len(run.parts)} parts")
    base = config or PipelineConfig()
    pipes = [Pipeline(list(run.parts), loss_fn, optimizer, replace(base, schedule=run.schedule)) for run in runs]
    cpu, wall = timed_steps(pipes, [batch] * len(runs), steps, warmup, cpu_timer)
    samples = gathered_samples([(run.schedule, run.groups) for run in runs], cpu)
    method = (f"{', '.join(f'{r.schedule.name} M={r.schedule.num_microbatches}' for r in runs)} on {ranks} ranks "
              f"with the real parts: median CPU time per rank of {steps} steps each, least squares over "
              f"{len(samples)} rank-runs for the compute scale and the per-action, per-message and per-step work")
    key = {(r.schedule.name, r.schedule.num_microbatches): w for r, w in zip(runs, wall, strict=True)}
    return OverheadCalibration(solve_overhead(samples, method, fit_scale=True), tuple(samples), key)
