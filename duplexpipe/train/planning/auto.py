"""The planning step before a Pipeline is built (`plan_pipeline`): a config resolved into what a Pipeline runs; with
schedule="auto" the parts measured (rank 0's profile, the in-pipeline calibration, cached) and planned."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from duplexpipe.comm.methods import check_optimizer
from duplexpipe.config.pipeline import resolve_schedule as resolve_schedule
from duplexpipe.dp_options.compression import AdaptiveOptions, NoCompression, Options, compression_options
from duplexpipe.model.split import Partition
from duplexpipe.model.stages import PartInit, PartSource, as_factory, materialize_part
from duplexpipe.parallel import OptimizerFactory
from duplexpipe.parallel.compressed import check_dgc_momentum
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.parallel.tied import find_tied
from duplexpipe.parallel.zero_config import check_tied
from duplexpipe.planner.calibrate import with_calibration
from duplexpipe.planner.calibration_cache import CalibrationCache, default_cache_dir
from duplexpipe.planner.candidates import CHECKPOINTING, microbatch_counts
from duplexpipe.planner.dp_comm import UNMEASURED, compression
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import Profile
from duplexpipe.runtime.backend import default_device
from duplexpipe.runtime.structure import flatten, map_leaves, split
from duplexpipe.schedules.ir import Schedule
from duplexpipe.sizes import memory_bytes
from duplexpipe.tp.parallelize import check_tensor_parallel
from duplexpipe.tp.plans import TPPlan
from duplexpipe.train.pipeline_config import (
    AUTO,
    AUTO_PLAN_KEYS,
    AUTO_PROFILE_KEYS,
    LossFn,
    PipelineConfig,
    check_auto_options,
    with_choice,
    with_defaults,
)
from duplexpipe.train.planning.calibration import (
    Calibration,
    CalibrationSetup,
    calibrate,
    measure_host_link,
    measure_link,
    measure_tp_link,
)
from duplexpipe.train.planning.choice import NO_LIMIT, AutoChoice, RunPlan
from duplexpipe.train.planning.measure import cache_evict_bytes, profile_parts
from duplexpipe.train.planning.measure_cache import (
    cache_of,
    cached_profile,
    machine_signature,
    parts_digest,
    sample_signature,
)
from duplexpipe.train.precision import autocast_dtype

LOGGER = logging.getLogger("duplexpipe.plan")


@dataclass(frozen=True)
class PlanSetup:
    """Where schedule="auto" plans: this process's place in P x D, the device, and the parts' init."""

    groups: ParallelGroups
    """P, D and this process's pipeline rank (and the groups the calibration trains over)."""
    device: torch.device
    """Where the parts run."""
    init: PartInit | None = None
    """init(part, k) for parts on the meta device."""
    tp_plan: TPPlan | None = None
    """The tensor-parallel plan of the stages (with tp > 1: profiled for its collectives and replicated bytes)."""
    sequence_parallel: bool = False
    """PipelineConfig.sequence_parallel."""


@dataclass(frozen=True)
class PlannedPipeline:
    """What the planning step resolved, for one mesh: exactly what `Pipeline(parts, loss_fn, optimizer, plan)` builds
    and runs (the parts given to the Pipeline are those given to `plan_pipeline`; with "auto" the Pipeline merges
    them as the plan says)."""

    config: PipelineConfig
    """The config with every field the run needs set (M, ZeRO stage, gradient compression)."""
    schedule: Schedule
    """The schedule to run, for the pipeline's P ranks."""
    plan: RunPlan
    """What runs: schedule, M, ZeRO stage and gradient compression."""
    sizes: tuple[int, int, int]
    """The (P, D, T) of the mesh it was planned for."""
    auto: AutoChoice | None = None
    """schedule="auto": the planner's whole choice (its table: `auto.result.table()`, the merging of the given parts:
    `auto.groups`); None otherwise."""

    def merged_parts(self, parts: PartSource) -> PartSource:
        """The given parts as the schedule's model parts (with "auto": neighbours merged into PartChains)."""
        if self.auto is None:
            return parts
        if as_factory(parts) is not None:
            raise ValueError("a plan of schedule='auto' merges the model parts it was planned with: pass them as a "
                             "list, not a part factory")
        given = list(parts)  # type: ignore[arg-type]
        if len(given) != sum(self.auto.groups):
            raise ValueError(f"the plan was made for {sum(self.auto.groups)} model parts, but {len(given)} were given")
        return self.auto.merged_parts(given)

    def merged_init(self, init: PartInit | None) -> PartInit | None:
        """`init(part, k)` for `merged_parts`' parts."""
        return init if self.auto is None else self.auto.merged_init(init)

    def merged_partition(self, partition: Partition | None) -> Partition | None:
        """The given parts' Partition for `merged_parts`' parts (None stays None)."""
        return partition if self.auto is None else self.auto.merged_partition(partition)


def plan_pipeline(parts: PartSource, loss_fn: LossFn, optimizer: OptimizerFactory,
                  config: PipelineConfig | None = None, *, mesh: DeviceMesh | None = None,
                  device: torch.device | str | None = None, init: PartInit | None = None, sample_input: Any = None,
                  sample_targets: Any = None, tp_plan: TPPlan | None = None) -> PlannedPipeline:
    """The plan a Pipeline of `parts` on `mesh` builds (the public step before construction).

    A named or given schedule is built as it stands (fields left unset at their defaults; nothing is measured).
    schedule="auto" measures the parts on a sample (`sample_input` / `sample_targets`: one step's batch of this
    replica, as given to `step`): rank 0's profile and a few seconds of calibration steps on every rank, cached per
    parts and machine; then it plans for this P, D and batch size under `config.memory_limit` (fields set in the
    config are fixed), logs the choice once (rank 0, logger "duplexpipe.plan") and says how to merge the parts for
    the winner (see `choose`). Collective with "auto": call on every rank. Under tensor parallelism (tp > 1) "auto"
    plans this mesh's P, D and T with each TP rank's share of the costs (`planner.tp_comm`), the parts profiled whole
    with `tp_plan` (`tp.facts`). A limit no candidate fits raises ValueError on every rank, naming the
    smallest feasible cap."""
    config = config or PipelineConfig()
    groups = ParallelGroups.from_mesh(mesh)
    if config.schedule != AUTO:
        return resolved(config, groups)
    check_tensor_parallel(parts, tp_plan, groups, config.sequence_parallel)
    where = torch.device(device) if device is not None else default_device()
    setup = PlanSetup(groups, where, init, tp_plan if groups.tp_size > 1 else None, config.sequence_parallel)
    choice = choose(parts, loss_fn, optimizer, config, setup, (sample_input, sample_targets))
    return PlannedPipeline(choice.applied(config), choice.schedule, choice.plan, _sizes(groups), choice)


def resolved(config: PipelineConfig, groups: ParallelGroups) -> PlannedPipeline:
    """The plan of a named or given schedule (not "auto"): built as it stands, unset fields at their defaults;
    nothing is measured."""
    if config.schedule == AUTO:
        raise ValueError("schedule='auto' is planned before a Pipeline is built: plan = duplexpipe.plan_pipeline("
                         "parts, loss_fn, optimizer, config, mesh=..., sample_input=..., sample_targets=...), then "
                         "Pipeline(parts, loss_fn, optimizer, plan, mesh=...) (Pipeline.from_layers and "
                         "from_pretrained do both)")
    config = with_defaults(config)
    schedule = resolve_schedule(config, groups.pp_size)
    run = RunPlan(schedule.name, schedule.num_microbatches, config.data_parallel.zero_stage or 0,
                  compression_options(config.data_parallel.grad_compression),
                  reshard_window=config.data_parallel.reshard_window,
                  activation_checkpointing=config.activation_checkpointing
                  if config.activation_checkpointing in (True, "full", "selective") else False,
                  activation_offload=config.activation_offload)
    return PlannedPipeline(config, schedule, run, _sizes(groups))


def _sizes(groups: ParallelGroups) -> tuple[int, int, int]:
    return groups.pp_size, groups.dp_size, groups.tp_size


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def _profile(parts: Sequence[nn.Module], loss_fn: LossFn, sample: tuple[Any, Any], microbatches: int,
             kwargs: dict[str, Any], setup: PlanSetup, dtype: torch.dtype | None) -> Profile:
    """Profile copies of the parts on the sample's first of `microbatches` microbatches (as the runtime splits it)."""
    inputs, targets = sample
    first = split(inputs, microbatches, "sample_input")[0]
    target = split(targets, microbatches, "sample_targets")[0] if targets is not None else None
    copies = [materialize_part(parts, k, setup.device, setup.init) for k in range(len(parts))]
    move = (lambda t: t.to(setup.device))  # noqa: E731
    first = map_leaves(move, first)
    target = map_leaves(move, target) if target is not None else None
    loss = loss_fn if target is not None else None
    with _autocast(setup.device, dtype):
        if "evict_bytes" not in kwargs:  # as many bytes as one microbatch keeps through the model, at least 2 x L2
            sizes = profile_parts(copies, first, target=target, loss_fn=loss, repeats=1, warmup=0, fit_rows=0,
                                  fused=False, timer=time.perf_counter, selective=False)
            kwargs = {**kwargs, "evict_bytes": max(cache_evict_bytes(), sum(p.activation_bytes for p in sizes.parts))}
        return profile_parts(copies, first, target=target, loss_fn=loss, meta={"source": "schedule='auto'"},
                             tp_plan=setup.tp_plan, **kwargs)


def _shared_profile(make: Callable[[], Profile]) -> Profile:
    """Rank 0's profile on every rank (timings differ per process); a failure on rank 0 is raised everywhere."""
    if not (dist.is_available() and dist.is_initialized()):
        return make()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload = [make().to_dict()]
        except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait forever
            payload = [f"{type(exc).__name__}: {exc}"]
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise ValueError(f"schedule='auto': rank 0 failed to profile the model parts ({payload[0]})")
    return Profile.from_dict(payload[0], "rank 0's profile")


def probe_optimizer(optimizer: OptimizerFactory) -> torch.optim.Optimizer | None:
    """What `optimizer` builds on one parameter (its type and hyperparameters), or None when it cannot."""
    try:
        return optimizer([nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - an optimizer that needs the real parameters: checked when it is built
        return None


def trainer_refusal(config: PipelineConfig, probe: torch.optim.Optimizer | None, parts: Sequence[nn.Module],
                    dp: int) -> Callable[[int, Options], str | None]:
    """The trainer's rule for a (ZeRO stage, compression) pair under `config`: PipelineConfig's own checks
    (ZeRO with the method, ZeroOptions, dp_strategy, clipping with DGC), the sparsifiers' optimizer checks on
    the optimizer `probe` (`probe_optimizer`; None: not checked here), and ZeRO with tied weights. Returns why
    it refuses the pair (its first line), or None."""
    tied = [t.places for t in find_tied(parts)]

    def rule(zero: int, options: Options) -> str | None:
        try:
            with_choice(replace(config, schedule="1f1b", schedule_options={}, memory_limit=None), 1, zero, options)
            if probe is not None:
                check_optimizer(options, probe)
                check_dgc_momentum(options, probe)
            check_tied(zero, tied, dp)
        except ValueError as exc:
            return str(exc).splitlines()[0]
        return None
    return rule


def _plan_config(config: PipelineConfig, options: dict[str, Any], rows: int, setup: PlanSetup,
                 refusal: Callable[[int, Options], str | None]) -> PlanConfig:
    """The planner's settings: schedule_options, with the fields the user fixed in `config` as the only choice."""
    values: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()
                              if k in AUTO_PLAN_KEYS}
    if config.num_microbatches is not None:
        values["microbatches"] = (config.num_microbatches,)
    dp = config.data_parallel
    if dp.zero_stage is not None:
        values["zero_stages"] = (dp.zero_stage,)
    if dp.reshard_window is not None:
        values["reshard_windows"] = (dp.reshard_window,)
    values["checkpointing"] = planned_checkpointing(config.activation_checkpointing)
    if config.activation_offload is not False:  # fixed as given, planned as none (its memory counted whole)
        values["host_link"] = None
    if dp.grad_compression is not None:
        fixed = compression_options(dp.grad_compression)
        # adaptive: the planner picks the controller's starting rung among the ladder's (ZeRO has no adaptive form)
        values["compressions"] = fixed.gradient_rungs() if isinstance(fixed, AdaptiveOptions) else (fixed,)
        if isinstance(fixed, AdaptiveOptions):
            values["zero_stages"] = (0,)
    cap = memory_bytes(config.memory_limit)
    groups = setup.groups
    return PlanConfig(ranks=groups.pp_size, batch=rows * groups.dp_size, memory=cap if cap is not None else NO_LIMIT,
                      dp=groups.dp_size, refusal=refusal, tp=groups.tp_size, sequence_parallel=setup.sequence_parallel,
                      **values)


def planned_checkpointing(setting: object) -> tuple[str, ...]:
    """What the planner may choose for PipelineConfig.activation_checkpointing: off, selective or full on every
    stage when it is left at False (the default); True or "full" fixes full, "selective" selective; any other
    policy (stage indices, ...) is fixed as given and planned as off (its memory counted whole, on the safe
    side)."""
    if setting is False:
        return CHECKPOINTING
    if setting is True or setting == "full":
        return ("full",)
    return ("selective",) if setting == "selective" else ("off",)


def _fingerprint(parts: Sequence[nn.Module], sample: tuple[Any, Any], config: PipelineConfig, setup: PlanSetup,
                 profile_kwargs: dict[str, Any], rows: tuple[int, ...], calibration: Calibration,
                 optimizer_type: str) -> dict[str, Any]:
    """What the cached measurements depend on: the parts, the sample, P and D, the machine, the runtime's settings."""
    return {"parts": parts_digest(parts), "sample": sample_signature(sample[0]),
            "targets": sample_signature(sample[1]), "ranks": setup.groups.pp_size, "dp": setup.groups.dp_size,
            "tp": setup.groups.tp_size, "sequence_parallel": setup.sequence_parallel,
            "device": setup.device.type, "machine": machine_signature(), "precision": config.precision.dtype,
            "activation_checkpointing": repr(config.activation_checkpointing),
            "p2p_compression": repr(config.precision.p2p_compression),
            "count_saved_bytes": config.observe.count_saved_bytes, "record_timeline": config.observe.record_timeline,
            "check_inputs": config.safety.check_inputs_every_step,
            "optimizer": optimizer_type, "profile": {k: _name(v) for k, v in profile_kwargs.items()},
            "profile_rows": list(rows), "calibration": [calibration.enabled, calibration.budget_s]}


def _name(value: Any) -> str:
    """A setting as the cache key sees it: a callable (a timer) by its name, anything else by its repr."""
    return getattr(value, "__qualname__", type(value).__qualname__) if callable(value) else repr(value)


def _settings(options: dict[str, Any]) -> tuple[Calibration, CalibrationCache | None]:
    """The calibration settings and the cache (None: no cache) of schedule_options. A scripted timer means a
    test or a custom measurement: no cache unless one is named."""
    scripted = "timer" in options or "cpu_timer" in options
    cache = cache_of(options.get("calibration_cache", None if scripted else default_cache_dir()))
    calibration = Calibration(bool(options.get("calibrate", True)), float(options.get("calibration_budget_s", 3.0)),
                              options.get("cpu_timer", time.process_time))
    return calibration, cache


def choose(parts: PartSource, loss_fn: LossFn, optimizer: OptimizerFactory, config: PipelineConfig, setup: PlanSetup,
           sample: tuple[Any, Any] | None) -> AutoChoice:
    """Measure (cached, `measure`), plan for P x D and the sample's batch size with what the calibration measured
    (`with_calibration`), log the choice once (rank 0). Fields the user set in `config` (num_microbatches,
    zero_stage, grad_compression) are the planner's only choice for them. Raises ValueError on every rank, before
    any training, when the parts or the sample are unusable or no candidate fits the limit (naming the smallest
    feasible cap)."""
    profile, plan_config, source = measure(parts, loss_fn, optimizer, config, setup, sample)
    links = [key for key in ("p2p_link", "tp_link", "host_link") if key not in config.schedule_options
             and (key != "host_link" or config.activation_offload is False)]  # a fixed offload is planned as none
    profile, plan_config, note = with_calibration(profile, plan_config, links)
    return _decide(profile, plan_config, f"{source}; {note}" if note else source)


def measure(parts: PartSource, loss_fn: LossFn, optimizer: OptimizerFactory, config: PipelineConfig, setup: PlanSetup,
            sample: tuple[Any, Any] | None) -> tuple[Profile, PlanConfig, str]:
    """What schedule="auto" plans with: the profile (measured, or from the cache), the planner's settings and where
    the profile came from. Collective: call on every rank.

    `sample` is (inputs, targets) of one step's batch on this replica. The profile is rank 0's, on the
    sample's largest candidate microbatch (affine down to the smallest), and the calibration trains
    `calibration_runs` with the real parts on every rank (`calibration.CalibrationTrainer`: the runtime, no
    Pipeline), kept in the profile's overhead and meta (its runs' walls, the measured link).
    """
    check_auto_options(config)
    options = dict(config.schedule_options)
    if as_factory(parts) is not None:
        raise ValueError("schedule='auto' needs the model parts as a list (it merges neighbouring parts for the "
                         "chosen schedule); got a part factory")
    given = list(parts)  # type: ignore[arg-type]
    if sample is None or sample[0] is None:
        raise ValueError("schedule='auto' profiles the model on a sample: pass sample_input= (a batch as given to "
                         "step) and sample_targets= to plan_pipeline (or Pipeline.from_layers)")
    rows = int(flatten(sample[0], "sample_input")[1][0].shape[0])
    probe = probe_optimizer(optimizer)
    refusal = trainer_refusal(config, probe, given, setup.groups.dp_size)
    plan_config = _plan_config(config, options, rows, setup, refusal)
    counts = microbatch_counts(plan_config)
    measured = sorted(set(counts) | set(microbatch_counts(replace(plan_config, microbatches=None))))
    small, large = rows // max(measured), rows // min(measured)
    kwargs = {"fit_rows": small if 1 <= small < large else 0,
              **{k: options[k] for k in AUTO_PROFILE_KEYS if k in options}}
    calibration, cache = _settings(options)

    dtype = autocast_dtype(config.precision.dtype)
    trainees = CalibrationSetup(loss_fn, optimizer, config, setup.groups, setup.device, setup.init)

    def fresh() -> Profile:
        profile = _shared_profile(lambda: _profile(given, loss_fn, sample, min(measured), kwargs, setup, dtype))
        if not calibration.enabled:
            return profile
        fitted, samples, walls = calibrate(profile, given, sample, counts=measured, setup=trainees,
                                           settings=calibration)
        meta = dict(profile.meta, calibration_walls=walls, calibration_mesh=_calibration_mesh(setup, rows),
                    calibration_samples=[[s.actions, s.messages, s.seconds, s.compute] for s in samples])
        meta.update(_links(profile.at_microbatch(rows / min(measured)), setup, options))
        if isinstance(fitted, str):
            LOGGER.warning("schedule='auto': the in-pipeline calibration could not separate its terms (%s); "
                           "planning without the runtime's work", fitted)
            return replace(profile, meta=meta)
        return replace(profile, overhead=fitted, meta=meta)

    fingerprint = _fingerprint(given, sample, config, setup, kwargs, (small, large), calibration, type(probe).__name__)
    profile, source = cached_profile(cache, fingerprint, fresh)
    return profile, plan_config, source


def _calibration_mesh(setup: PlanSetup, rows: int) -> dict[str, Any]:
    """What the calibration ran on: P, the batch of a replica and, on CPUs, the cores one replica's ranks shared
    (this process's CPU affinity over D; on accelerators none: a device per rank). `with_calibration` plans with it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shared = cores / setup.groups.dp_size if setup.device.type == "cpu" else None
    return {"ranks": setup.groups.pp_size, "batch": rows, "cores": shared}


def _links(profile: Profile, setup: PlanSetup, options: dict[str, Any]) -> dict[str, list[float]]:
    """The links the calibration measures (collective: call on every rank), those `options` does not give: the
    stage-to-stage link with the largest message of `profile` (at the smallest candidate microbatch's scale),
    under TP the TP group's with its largest collective, and on CUDA the copies to pinned host memory (what
    activation offload is planned with)."""
    groups = setup.groups
    out: dict[str, list[float]] = {}
    if "host_link" not in options and setup.device.type == "cuda":
        out["host_link"] = list(measure_host_link(setup.device))
    if "p2p_link" not in options:
        message = max((p.output_bytes for p in profile.parts[:-1]), default=4)
        out["p2p_link"] = list(measure_link(groups.pp_rank, int(message)))
    if "tp_link" not in options and groups.tp_size > 1:
        facts = [p.tp for p in profile.parts if p.tp is not None]
        largest = max((f.forward_bytes // max(f.forward_collectives, 1) for f in facts), default=4)
        out["tp_link"] = list(measure_tp_link(groups.tp_group, largest))
    return out


def _decide(profile: Profile, config: PlanConfig, source: str) -> AutoChoice:
    """Plan, turn the best row into what runs, log it on rank 0."""
    result = plan(profile, config)
    schedule = result.schedule
    assert schedule is not None
    best = result.best
    method = next((compression(s) for s in config.compressions or () if compression(s).name == best.compression),
                  None) or compression(best.compression)
    if method.note == UNMEASURED:
        LOGGER.warning("schedule='auto': no measured wire ratio for grad_compression %r; the plan models the "
                       "data-parallel reduction uncompressed", method.name)
    run = RunPlan(best.schedule, best.microbatches, best.zero, method.options or NoCompression(), best.step_s,
                  best.window, best.activation_checkpointing, best.offload)
    choice = AutoChoice(result, profile, schedule, tuple(profile.group_sizes(schedule.num_groups)), run, source)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        LOGGER.info("%s\n%s", choice.summary(), result.table())
    return choice
