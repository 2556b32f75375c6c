"""schedule="auto"'s in-pipeline calibration: the merged parts trained on `PipelineRuntime` (no Pipeline) on a few
schedules, each rank's CPU time per step solved for the runtime's work, and the stage-to-stage link measured."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.comm.meter import WireMeter
from duplexpipe.dp_options.compression import NoCompression
from duplexpipe.dp_options.zero import ZeroOptions
from duplexpipe.model.stages import PartInit, build_stage_modules, resolve_checkpointing
from duplexpipe.parallel import OptimizerFactory, StrategyContext, final_order, make_strategy
from duplexpipe.parallel.grads import clip_factor
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.parallel.tied import TiedGrads, find_tied
from duplexpipe.planner.calibrate import MAX_SCALE, calibration_rounds, calibration_runs, calibration_schedule
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead
from duplexpipe.planner.runtime_work import OverheadSample, rank_counts, rank_work, solve_overhead
from duplexpipe.runtime import PipelineRuntime
from duplexpipe.runtime.structure import flatten
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.experts import Experts
from duplexpipe.train.part_chain import merge_init, merge_parts
from duplexpipe.train.pipeline_config import LossFn, PipelineConfig, runtime_config

CpuTimer = Callable[[], float]
"""This process's CPU seconds (all its threads: gloo's included); time.process_time by default."""
LINK_PROBE_BYTES = 2**20
"""The larger round trip of the link measurement is at least this many bytes (a transfer time above the noise)."""


class Steppable(Protocol):
    """What `timed_steps` times: anything that trains one step on a batch (a `CalibrationTrainer`, a Pipeline)."""

    def step(self, inputs: Any, targets: Any) -> float:
        """One training step."""


@dataclass(frozen=True)
class CalibrationSetup:
    """What the calibration trains with: the user's loss and optimizer, the Pipeline's settings, and where."""

    loss_fn: LossFn
    """The Pipeline's loss."""
    optimizer: OptimizerFactory
    """The Pipeline's optimizer factory."""
    config: PipelineConfig
    """The Pipeline's config: its runtime settings, precision, clipping and checkpointing (its data-parallel
    compression and ZeRO stage are not run: the planner models those itself)."""
    groups: ParallelGroups
    """Where this process sits (P x D)."""
    device: torch.device
    """Where the parts run."""
    init: PartInit | None = None
    """init(part, k) of the given parts on the meta device."""


class CalibrationTrainer:
    """One calibration schedule trained on `PipelineRuntime` directly, a step as a Pipeline takes one: this rank's
    stages of the merged parts, the runtime with the config's settings, and per step zero_grad, the schedule, the
    data-parallel reduction (exact all-reduce, no ZeRO), tied weights summed, the norm when the config clips or
    scales the loss, one optimizer step and the MoE expert-bias update. Collective: build it on every rank."""

    def __init__(self, schedule: Schedule, parts: Sequence[nn.Module], init: PartInit | None,
                 setup: CalibrationSetup) -> None:
        cfg, groups, device = setup.config, setup.groups, setup.device
        ckpt = resolve_checkpointing(cfg.activation_checkpointing, schedule)
        modules = build_stage_modules(schedule, groups.pp_rank, parts, init=init, checkpoint_stages=ckpt,
                                      device=device)
        self.experts = Experts(modules, schedule, groups, ckpt, device)
        self.tied = TiedGrads(find_tied(parts), schedule, groups.pp_rank, modules, groups.pp_group)
        settings = runtime_config(cfg, fb_overlap=self.experts.note_overlap(cfg.fb_overlap),
                                  on_grads_ready=self._grads_ready, p2p_meter=WireMeter())
        self.runtime = PipelineRuntime(schedule, modules, setup.loss_fn, group=groups.pp_group, device=device,
                                       config=settings, job_group=dist.group.WORLD if groups.dp_size > 1 else None)
        plan = self.runtime.plan
        self.dp = make_strategy(StrategyContext(
            modules, schedule, tuple(final_order(plan.grads_final, plan.mirrored)), groups, setup.optimizer, device,
            self.bounded, NoCompression(), cfg.data_parallel.grad_bucket_bytes, 0, ZeroOptions(), self.experts.shard()))
        self.dp.counted = self.tied.counted(self.dp.counted)
        self.clip = cfg.grad_clip_norm
        self.norm = cfg.grad_clip_norm is not None or cfg.precision.dtype == "fp16"

    def _grads_ready(self, stage: int) -> None:
        self.dp.grads_ready(stage)

    def bounded(self, work: Any, what: str) -> None:
        """The runtime's bounded, failure-aware wait for a collective of the job."""
        self.runtime.bounded(work, what, "all ranks of the job")

    def step(self, inputs: Any, targets: Any) -> float:
        """One training step on the batch; returns its mean loss."""
        self.dp.zero_grad()
        self.dp.begin_call(True, 1.0)
        result = self.runtime.step(inputs, targets, loss_scale=1.0)
        try:
            loss = result.loss
            self.dp.finish()
            self.tied.sum_grads(wait=self.bounded)
            norm, _ = self.dp.norm_and_overflow(self.norm)
            self.dp.step(clip_factor(norm or 0.0, self.clip))
            self.experts.after_step(applied=True, wait=self.bounded)
        except BaseException as exc:  # the other ranks wait in collectives: tell them
            self.runtime.report_failure(exc)
            raise
        return loss


def timed_steps(pipes: Sequence[Steppable], batches: Sequence[tuple[Any, Any]], steps: int, warmup: int,
                cpu_timer: CpuTimer, budget_s: float | None = None) -> tuple[list[float], list[float]]:
    """Round-robin steps (step i of each pipe, the first one rotating), each between barriers: per pipe,
    this rank's median CPU seconds and the slowest rank's median wall seconds of the measured steps.

    `budget_s`: measure only as many rounds (3 to `steps`) as fit this many seconds, judged by the last
    warm-up round's slowest-rank wall time (the same on every rank); None: `steps` rounds.
    """
    cpu: list[list[float]] = [[] for _ in pipes]
    wall: list[list[float]] = [[] for _ in pipes]
    rounds, step = warmup + steps, 0
    while step < rounds:
        round_s = 0.0
        for k in range(len(pipes)):
            c = (step + k) % len(pipes)
            dist.barrier()
            start_cpu, start = cpu_timer(), time.perf_counter()
            pipes[c].step(*batches[c])
            used, took = cpu_timer() - start_cpu, torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's wall time
            round_s += float(took.item())
            if step >= warmup:
                cpu[c].append(used)
                wall[c].append(float(took.item()))
        step += 1
        if budget_s is not None and step == warmup:
            rounds = warmup + calibration_rounds(round_s, budget_s, least=min(3, steps), most=steps)
    return [statistics.median(t) for t in cpu], [statistics.median(t) for t in wall]


def gathered_samples(runs: Sequence[tuple[Schedule, Sequence[PartProfile]]], cpu: Sequence[float],
                     pp_rank: int) -> list[OverheadSample]:
    """Every rank's sample of every run (gathered over the default group): its actions and messages in the
    run's schedule, its CPU seconds per step, and its parts' profiled compute (`rank_work` of the run's groups)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pp_rank, list(cpu)))
    samples = []
    for rank, seconds in gathered:
        for (schedule, groups), took in zip(runs, seconds, strict=True):
            actions, messages = rank_counts(schedule)[rank]
            samples.append(OverheadSample(actions, messages, took, rank_work(schedule, groups)[rank]))
    return samples


@dataclass(frozen=True)
class Calibration:
    """How schedule="auto" measures the runtime inside a running pipeline (schedule_options)."""

    enabled: bool = True
    """Run the in-pipeline calibration ("calibrate"); False: plan with the profile alone (no runtime work)."""
    budget_s: float = 3.0
    """Seconds the calibration's measured steps may take ("calibration_budget_s"; 3 to 20 rounds of its runs)."""
    cpu_timer: CpuTimer = time.process_time
    """This process's CPU seconds ("cpu_timer"; tests script it)."""


def calibrate(profile: Profile, parts: Sequence[nn.Module], batch: tuple[Any, Any], *, counts: Sequence[int],
              setup: CalibrationSetup, settings: Calibration
              ) -> tuple[RuntimeOverhead | str, list[OverheadSample], list[list[Any]]]:
    """The runtime's work per compute action, SEND/RECV and step and the parts' in-pipeline compute scale,
    solved (`solve_overhead(fit_scale=True)`) from each rank's CPU time per step of `calibration_runs`
    (the parts merged as the planner groups them, trained on `batch` by `CalibrationTrainer`s, steps
    alternating, at most `settings.budget_s` of measured steps). Call on every rank; every rank solves the
    same gathered samples. Returns the fit (or the solver's complaint, the same on every rank, when the
    samples cannot separate the terms; see `fit_in_pipeline`), the samples, and each run's [schedule, M,
    slowest rank's median wall seconds per step] (kept with the profile: how the calibration ran)."""
    rows = int(flatten(batch[0], "sample_input")[1][0].shape[0])
    ranks = setup.groups.pp_size
    runs, trainers = [], []
    for name, m in calibration_runs(ranks, counts, profile.num_parts):
        schedule = calibration_schedule(name, ranks, m)
        sizes = profile.group_sizes(schedule.num_groups)
        runs.append((schedule, profile.at_microbatch(rows / m).grouped(schedule.num_groups, sizes)))
        trainers.append(CalibrationTrainer(schedule, merge_parts(parts, sizes), merge_init(setup.init, sizes), setup))
    cpu, wall = timed_steps(trainers, [batch] * len(trainers), 20, 1, settings.cpu_timer, settings.budget_s)
    walls = [[s.name, s.num_microbatches, w] for (s, _), w in zip(runs, wall, strict=True)]
    method = (f"{', '.join(f'{s.name} M={s.num_microbatches}' for s, _ in runs)} on {ranks} ranks with the real "
              "parts (schedule='auto'): median CPU time per rank per step, least squares")
    samples = gathered_samples(runs, cpu, setup.groups.pp_rank)
    return fit_in_pipeline(samples, method), samples, walls


def fit_in_pipeline(samples: Sequence[OverheadSample], method: str) -> RuntimeOverhead | str:
    """`solve_overhead(fit_scale=True)`; when that fails (the scale comes out 0: the samples' CPU time does not
    follow their compute) or puts the scale outside [1/MAX_SCALE, MAX_SCALE], the terms solved with the scale
    held at 1 (each part costs its profile, the rest is runtime work), as the method then says; the solver's
    complaint when even that cannot separate the terms."""
    try:
        fitted = solve_overhead(samples, method, fit_scale=True)
        if 1 / MAX_SCALE <= fitted.compute_scale <= MAX_SCALE:
            return fitted
        why = f"the fitted compute scale {fitted.compute_scale:.3g} is implausible"
    except ValueError as exc:
        why = str(exc).split(":")[0]
    try:
        return solve_overhead(samples, f"{method}; {why}: the scale held at 1", fit_scale=False)
    except ValueError as exc:
        return str(exc)


def _round_trip(peer: int, nbytes: int, reps: int) -> float:
    """The fastest of `reps` round trips of `nbytes` to `peer` and back (rank 0), or echoed (the peer), in
    seconds: other work on the machine only ever adds time."""
    buf = torch.zeros(max(1, nbytes // 4))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure_link(pp_rank: int, nbytes: int, reps: int = 20) -> tuple[float, float]:
    """The stage-to-stage link as the planner models it, (latency s per message, bytes/s), from the fastest
    round trips of 4 and max(`nbytes`, LINK_PROBE_BYTES) bytes between world rank 0 and the first rank of
    another pipeline rank (rank 0's figures on every rank; call on every rank). One pipeline rank, or no
    measurable transfer time: infinite bandwidth."""
    nbytes = max(nbytes, LINK_PROBE_BYTES)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, pp_rank)
    peer = next((r for r, p in enumerate(ranks) if p != ranks[0]), None)
    found: list[Any] = [(0.0, math.inf)]
    if peer is not None and dist.get_rank() in (0, peer):
        small, big = _round_trip(peer, 4, reps), _round_trip(peer, nbytes, reps)
        found = [(small / 2, (nbytes - 4) / ((big - small) / 2) if big > small else math.inf)]
    dist.broadcast_object_list(found, src=0)
    return found[0][0], found[0][1]


HOST_PROBE_BYTES = 64 * 2**20
"""Bytes of the copies `measure_host_link` times (a few milliseconds each way on a PCIe link)."""


def measure_host_link(device: torch.device, nbytes: int = HOST_PROBE_BYTES, reps: int = 5) -> tuple[float, float]:
    """The copy link between `device` and pinned host memory, as activation offload uses it, (latency s per copy,
    bytes/s): from the fastest of `reps` copies of 4 and `nbytes` bytes each way, the slower direction; rank 0's
    figures on every rank when a process group is up (call on every rank: every rank plans the same). ValueError
    for a device that is not CUDA."""
    if device.type != "cuda":
        raise ValueError(f"measure_host_link times copies to a CUDA device's host memory, got device {device}")

    def fastest(size: int, to_host: bool) -> float:
        gpu = torch.empty(max(1, size // 4), device=device)
        host = torch.empty(gpu.shape, pin_memory=True)
        samples = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            (host.copy_(gpu, non_blocking=True) if to_host else gpu.copy_(host, non_blocking=True))
            torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        return min(samples[1:])

    links = []
    for to_host in (True, False):
        small, big = fastest(4, to_host), fastest(nbytes, to_host)
        links.append((small, (nbytes - 4) / (big - small) if big > small else math.inf))
    found: list[Any] = [(max(lat for lat, _ in links), min(bw for _, bw in links))]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    return found[0][0], found[0][1]


def _all_reduce_time(group: Any, nbytes: int, reps: int) -> float:
    """The fastest of `reps` all-reduces of `nbytes` over `group` (seconds; the slowest rank of each)."""
    buf = torch.zeros(max(1, nbytes // 4))
    samples = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure_tp_link(tp_group: Any, nbytes: int, reps: int = 20) -> tuple[float, float]:
    """The TP group's link as `planner.tp_comm` prices it, (latency s per message, bytes/s each way), from the
    fastest all-reduces of 4 and max(`nbytes`, LINK_PROBE_BYTES) bytes over every TP group at once (a ring
    all-reduce over T ranks: 2(T-1) messages, 2(T-1)/T of the bytes each way); rank 0's figures on every rank
    (call on every rank). No measurable transfer time: infinite bandwidth."""
    nbytes = max(nbytes, LINK_PROBE_BYTES)
    tp = dist.get_world_size(tp_group)
    small, big = _all_reduce_time(tp_group, 4, reps), _all_reduce_time(tp_group, nbytes, reps)
    moved = 2 * (tp - 1) / tp * (nbytes - 4)
    found: list[Any] = [(small / (2 * (tp - 1)), moved / (big - small) if big > small else math.inf)]
    dist.broadcast_object_list(found, src=0)
    return found[0][0], found[0][1]


def _rounds(tp_group: Any, buf: torch.Tensor | None, busy_s: float, rounds: int, cpu_timer: CpuTimer) -> float:
    """Wall seconds per round of `rounds` rounds of `busy_s` CPU seconds of work, each followed by an all-reduce of
    `buf` over `tp_group` (None: no collective), after one barrier of the world."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        until = cpu_timer() + busy_s
        while cpu_timer() < until:
            pass
        if buf is not None:
            dist.all_reduce(buf, group=tp_group)
    return (time.perf_counter() - start) / rounds


def tp_collective_work(tp_group: Any, nbytes: int, busy_s: float, cores: float, *, rounds: int = 20,
                       repeats: int = 5, cpu_timer: CpuTimer = time.process_time) -> float:
    """Seconds of core work one TP collective of `nbytes` costs on a machine whose `cores` cores every rank of the
    world shares, as the planner's processor sharing charges it (`tp_comm` adds it to the passes).

    Every rank runs `repeats` x (`rounds` rounds of `busy_s` CPU seconds then an all-reduce over its TP group, then
    the same rounds without it), with no barrier between rounds, as TP ranks compute between collectives in a
    pipeline; per collective: the median over the repeats of (a round with it - a round without), times the share
    of a core each busy rank had, min(1, cores / world). On cores the ranks share, a rank that reaches a collective
    waits until its partners are scheduled and reach it too; a link's latency measured between barriers (the
    partners already running: `measure_tp_link`) leaves that out. Rank 0's figure on every rank (call on every
    rank)."""
    buf = torch.zeros(max(1, nbytes // 4))
    extra = []
    for _ in range(repeats):
        with_it = _rounds(tp_group, buf, busy_s, rounds, cpu_timer)
        extra.append(with_it - _rounds(tp_group, None, busy_s, rounds, cpu_timer))
    share = min(1.0, cores / dist.get_world_size())
    found: list[Any] = [max(0.0, statistics.median(extra)) * share]
    dist.broadcast_object_list(found, src=0)
    return float(found[0])
