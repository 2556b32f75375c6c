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
CpuTimer = Callable[[], float]  # this process's CPU seconds (all its threads: gloo's included)


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


def _world(what: str, steps: int, warmup: int, runs: Sequence[Any], ok: bool = True) -> int:
    """The world size; raises ValueError without a process group or with bad steps, warmup or runs."""
    if not dist.is_initialized():
        raise ValueError(f"{what} runs on every rank of an initialized process group")
    if steps < 1 or warmup < 0 or not runs or not ok:
        raise ValueError(f"{what} needs steps >= 1, warmup >= 0 and runs of M >= 1, got steps={steps}, "
                         f"warmup={warmup}, runs={list(runs)}")
    return dist.get_world_size()


def _samples(pipes: Sequence[Pipeline], batches: Sequence[tuple[Any, Any]], runs: Sequence[Schedule],
             groups: Sequence[Sequence[PartProfile]], steps: int, warmup: int, cpu_timer: CpuTimer,
             ) -> tuple[list[OverheadSample], list[float]]:
    """Round-robin steps between barriers; every rank's sample of every run, each run's median slowest-rank wall."""
    traces = harness.RoundRobin(list(zip(pipes, batches, strict=True)), lambda s, _: s[0].step(*s[1]),
                                cpu_timer=cpu_timer).run(steps, warmup)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ([statistics.median(t.cpu) for t in traces], list(groups)))
    samples = [OverheadSample(*rank_counts(schedule)[rank], took, rank_work(schedule, parts)[rank])
               for rank, (cpu, own) in enumerate(gathered)
               for schedule, took, parts in zip(runs, cpu, own, strict=True)]
    return samples, [statistics.median(t.wall) for t in traces]


@dataclass(frozen=True)
class OverheadCalibration:
    """What `measure_overhead` measured and solved."""

    overhead: RuntimeOverhead  # the solved per-action, per-message and per-step work
    samples: tuple[OverheadSample, ...]  # every rank's sample of every run
    wall_s: dict[tuple[str, int], float]  # (schedule, M) -> median seconds of the slowest rank's step
    tiny: PartProfile | None = None  # the 1-weight part on one message, timed alone in CPU time (None: real parts)

    @property
    def tiny_s(self) -> float:
        """F + I + W of the tiny part (0 without one)."""
        return 0.0 if self.tiny is None else self.tiny.forward_s + self.tiny.backward_s


def measure_overhead(message: Tensor, *, runs: Sequence[tuple[str, int]] | None = None, steps: int = 10,
                     warmup: int = 2, config: PipelineConfig | None = None,
                     cpu_timer: CpuTimer = time.process_time) -> OverheadCalibration:
    """Run (schedule, M) pairs with `TinyPart`s on messages like `message` on every rank of the default group and
    solve each rank's median CPU seconds per step, less its parts' compute, for the runtime's work per compute action,
    per SEND/RECV and per step (default runs: 1F1B at M = P and 2P, ZB-H1 at 2P). Call on every rank."""
    ranks = dist.get_world_size() if dist.is_initialized() else 0
    plan = list(runs) if runs is not None else [("1f1b", ranks), ("1f1b", 2 * ranks), ("zb-h1", 2 * ranks)]
    _world("measure_overhead", steps, warmup, plan, all(m >= 1 for _, m in plan))
    tiny = profile_parts([TinyPart()], message, repeats=5, warmup=2, fit_rows=0, timer=cpu_timer).parts[0]
    schedules = [build_schedule(name, ranks, m) for name, m in plan]
    pipes = [Pipeline([TinyPart() for _ in range(s.num_groups)], _loss, lambda p: torch.optim.SGD(p, lr=0.0),
                      replace(config or PipelineConfig(), schedule=name, num_microbatches=m))
             for s, (name, m) in zip(schedules, plan, strict=True)]
    batches = [(torch.cat([message.detach()] * m), torch.zeros(len(message) * m)) for _, m in plan]
    samples, wall = _samples(pipes, batches, schedules, [[tiny] * s.num_groups for s in schedules], steps, warmup,
                             cpu_timer)
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
    groups: Sequence[PartProfile]  # their profile at this schedule's microbatch (what a rank's compute is charged)


def measure_in_pipeline(runs: Sequence[CalibrationRun], batch: tuple[Tensor, Tensor], loss_fn: LossFn,
                        optimizer: harness.Optimizer, *, steps: int = 10, warmup: int = 2,
                        config: PipelineConfig | None = None,
                        cpu_timer: CpuTimer = time.process_time) -> OverheadCalibration:
    """Train `runs` (real parts, steps alternating between barriers) and solve each rank's median CPU seconds per step
    as alpha x its profiled compute + work per compute action, SEND/RECV and step. Call on every rank; raises
    ValueError when the samples cannot separate the terms."""
    ranks = _world("measure_in_pipeline", steps, warmup, [r.schedule.name for r in runs])
    for run in runs:
        if run.schedule.num_ranks != ranks or len(run.parts) != run.schedule.num_groups:
            raise ValueError(f"calibration run {run.schedule.name!r} needs {ranks} ranks and one part per model "
                             f"part ({run.schedule.num_groups}), got {run.schedule.num_ranks} ranks and "
                             f"{len(run.parts)} parts")
    pipes = [Pipeline(list(run.parts), loss_fn, optimizer, replace(config or PipelineConfig(), schedule=run.schedule))
             for run in runs]
    samples, wall = _samples(pipes, [batch] * len(runs), [r.schedule for r in runs], [r.groups for r in runs], steps,
                             warmup, cpu_timer)
    method = (f"{', '.join(f'{r.schedule.name} M={r.schedule.num_microbatches}' for r in runs)} on {ranks} ranks "
              f"with the real parts: median CPU time per rank of {steps} steps each, least squares over "
              f"{len(samples)} rank-runs for the compute scale and the per-action, per-message and per-step work")
    key = {(r.schedule.name, r.schedule.num_microbatches): w for r, w in zip(runs, wall, strict=True)}
    return OverheadCalibration(solve_overhead(samples, method, fit_scale=True), tuple(samples), key)
