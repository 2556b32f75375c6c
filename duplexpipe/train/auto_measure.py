"""schedule="auto" measures on the user path: rank 0's profile of the parts and an in-pipeline calibration of the
runtime's work (bounded in time), cached per parts and machine (`planner.calibration_cache`)."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.model.stages import PartInit
from duplexpipe.planner.calibrate import calibration_rounds, calibration_runs
from duplexpipe.planner.calibration_cache import CalibrationCache
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead
from duplexpipe.planner.runtime_work import OverheadSample, rank_counts, rank_work, solve_overhead
from duplexpipe.runtime.structure import WHOLE_MESSAGE, call, flatten, signature
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Schedule

CpuTimer = Callable[[], float]
"""This process's CPU seconds (all its threads: gloo's included); time.process_time by default."""
LOGGER = logging.getLogger("duplexpipe.plan")
LINK_PROBE_BYTES = 2**20
"""The larger round trip of the link measurement is at least this many bytes (a transfer time above the noise)."""
MAX_SCALE = 4.0
"""The in-pipeline compute scale the calibration trusts: within a factor of this of the profile."""


class Steppable(Protocol):
    """What the calibration trains: a Pipeline (`step(inputs, targets)`)."""

    def step(self, inputs: Any, targets: Any) -> float:
        """One training step."""


PipelineBuilder = Callable[[list[nn.Module], PartInit | None, Schedule], Steppable]
"""Builds a Pipeline of the given (merged) parts running `schedule` (the trainer passes one: train/ cannot import
the Pipeline class below itself)."""


class PartChain(nn.Module):
    """Model parts run one after another, each called on the previous one's output as the runtime
    calls a stage (a tuple/list as positional arguments, a dict as keyword arguments)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        setattr(self, WHOLE_MESSAGE, getattr(parts[0], WHOLE_MESSAGE, False))  # called as its first part is

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.parts[0](*args, **kwargs)
        for part in list(self.parts)[1:]:
            form, leaves = flatten(out, "output")
            out = call(part, form, leaves)
        return out


def merge_parts(parts: Sequence[nn.Module], counts: Sequence[int]) -> list[nn.Module]:
    """`parts` as len(counts) model parts of `counts` parts each, in order: a run of several becomes one PartChain."""
    out: list[nn.Module] = []
    start = 0
    for count in counts:
        run = list(parts[start:start + count])
        out.append(run[0] if count == 1 else PartChain(run))
        start += count
    return out


def merge_init(init: PartInit | None, counts: Sequence[int]) -> PartInit | None:
    """`init(part, k)` for `merge_parts`' parts: each given part k inside a chain is filled by init(part, k)."""
    if init is None:
        return None
    firsts = [sum(counts[:g]) for g in range(len(counts))]

    def fill(module: nn.Module, group: int) -> None:
        inner = module.parts if isinstance(module, PartChain) else [module]
        for offset, part in enumerate(inner):
            init(part, firsts[group] + offset)
    return fill


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


def calibrate(profile: Profile, parts: Sequence[nn.Module], init: PartInit | None, batch: tuple[Any, Any], *,
              ranks: int, pp_rank: int, counts: Sequence[int], build: PipelineBuilder,
              settings: Calibration) -> tuple[RuntimeOverhead | str, list[OverheadSample], list[list[Any]]]:
    """The runtime's work per compute action, SEND/RECV and step and the parts' in-pipeline compute scale,
    solved (`solve_overhead(fit_scale=True)`) from each rank's CPU time per step of `calibration_runs`
    (the parts merged as the planner groups them, trained on `batch` by `build`'s Pipelines, steps
    alternating, at most `settings.budget_s` of measured steps). Call on every rank; every rank solves the
    same gathered samples. Returns the fit (or the solver's complaint, the same on every rank, when the
    samples cannot separate the terms; see `fit_in_pipeline`), the samples, and each run's [schedule, M,
    slowest rank's median wall seconds per step] (kept with the profile: how the calibration ran)."""
    rows = int(flatten(batch[0], "sample_input")[1][0].shape[0])
    runs, pipes = [], []
    for name, m in calibration_runs(ranks, counts):
        schedule = registry.build(name, ranks, m)
        sizes = profile.group_sizes(schedule.num_groups)
        runs.append((schedule, profile.at_microbatch(rows / m).grouped(schedule.num_groups, sizes)))
        pipes.append(build(merge_parts(parts, sizes), merge_init(init, sizes), schedule))
    cpu, wall = timed_steps(pipes, [batch] * len(pipes), 20, 1, settings.cpu_timer, settings.budget_s)
    walls = [[s.name, s.num_microbatches, w] for (s, _), w in zip(runs, wall, strict=True)]
    method = (f"{', '.join(f'{s.name} M={s.num_microbatches}' for s, _ in runs)} on {ranks} ranks with the real "
              "parts (schedule='auto'): median CPU time per rank per step, least squares")
    samples = gathered_samples(runs, cpu, pp_rank)
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


def machine_signature() -> dict[str, Any]:
    """The machine as the cache tells machines apart: host, CPU model, cores, torch and its threads."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": model, "cores": cores, "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def parts_digest(parts: Sequence[nn.Module]) -> str:
    """A hash of the parts' structure: each module tree's repr and its parameters' and buffers' names, shapes,
    dtypes and devices (not their values: the costs do not depend on them)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            grad = getattr(tensor, "requires_grad", False)
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}:{grad};".encode())
    return digest.hexdigest()[:32]


def sample_signature(value: Any) -> str:
    """The sample's structure, shapes and dtypes (`runtime.structure.signature`)."""
    if value is None:
        return "None"
    return str(signature(value))


def cache_of(spec: Any) -> CalibrationCache | None:
    """The cache that schedule_options["calibration_cache"] names: a directory, or None/False for none."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, (str, os.PathLike)):
        return CalibrationCache(Path(spec))
    raise ValueError(f"schedule_options['calibration_cache'] must be a directory or None, got {spec!r}")


def cached_profile(cache: CalibrationCache | None, fingerprint: dict[str, Any],
                   measure: Callable[[], Profile]) -> tuple[Profile, str]:
    """Rank 0's cached profile for `fingerprint` on every rank, else `measure()` (called on every rank, a
    collective) stored by rank 0; with where it came from ("cache <path>", "measured, cached in <path>",
    "measured")."""
    lead = not dist.is_initialized() or dist.get_rank() == 0
    hit = cache.load(fingerprint) if cache is not None and lead else None
    found = [hit.to_dict() if hit is not None else None]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        assert cache is not None
        return Profile.from_dict(found[0], "calibration cache"), f"cache {cache.path(fingerprint)}"
    profile = measure()
    if cache is None:
        return profile, "measured"
    if lead:
        try:
            cache.store(fingerprint, profile)
        except OSError as exc:
            LOGGER.warning("schedule='auto': cannot write the calibration cache %s (%s)", cache.directory, exc)
            return profile, "measured"
    return profile, f"measured, cached in {cache.path(fingerprint)}"
