"""schedule="auto": measure the parts (rank 0's profile and an in-pipeline calibration, cached), plan the schedule,
M, ZeRO stage and gradient compression among what the trainer accepts, and say what will run (`RunPlan`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.comm import NoCompression, Options, check_optimizer, compression_options
from duplexpipe.dp_options import ZeroOptions, options_label
from duplexpipe.model.split import PartInfo, Partition
from duplexpipe.model.stages import PartInit, as_factory, materialize_part
from duplexpipe.parallel.compressed import check_dgc_momentum
from duplexpipe.parallel.tied import find_tied
from duplexpipe.parallel.zero_config import check_tied
from duplexpipe.planner.calibrate import fit_wall_scale
from duplexpipe.planner.calibration_cache import default_cache_dir
from duplexpipe.planner.dp_comm import UNMEASURED, Link, compression
from duplexpipe.planner.memory import format_bytes, parse_bytes
from duplexpipe.planner.plan import PlanConfig, PlanResult, microbatch_counts, plan
from duplexpipe.planner.profile import Profile
from duplexpipe.runtime.structure import flatten, map_leaves, split
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.auto_measure import (
    MAX_SCALE,
    Calibration,
    PartChain,
    PipelineBuilder,
    cache_of,
    cached_profile,
    calibrate,
    machine_signature,
    measure_link,
    merge_init,
    merge_parts,
    parts_digest,
    sample_signature,
)
from duplexpipe.train.measure import cache_evict_bytes, profile_parts

__all__ = ["AUTO", "NO_LIMIT", "AutoChoice", "AutoSetup", "PartChain", "RunPlan", "calibration_config", "check_fixed",
           "check_options", "choose", "memory_bytes", "probe_optimizer", "trainer_refusal"]

AUTO = "auto"
"""The PipelineConfig.schedule value that plans the schedule (the registry's `auto` generator is one candidate)."""
NO_LIMIT = 2**62
"""The cap planned with when no memory_limit is given (bytes; no candidate is rejected for memory)."""
PROFILE_KEYS = ("repeats", "warmup", "timer", "fit_rows", "fused", "evict_bytes")
"""schedule_options keys that go to `profile_parts`."""
CALIBRATION_KEYS = ("calibrate", "calibration_budget_s", "calibration_cache", "cpu_timer")
"""schedule_options keys of the in-pipeline calibration and its cache (`auto_measure.Calibration`)."""
PLAN_KEYS = tuple(f.name for f in fields(PlanConfig) if f.name not in ("ranks", "batch", "memory", "dp", "refusal"))
"""schedule_options keys that go to the planner's PlanConfig."""
FIXED = {"num_microbatches": "microbatches", "zero_stage": "zero_stages", "grad_compression": "compressions"}
"""PipelineConfig fields that, when set (not None), fix the planner's choice, and the schedule_options key that
narrows the planner's search when the field is left unset."""
LOGGER = logging.getLogger("duplexpipe.plan")


def memory_bytes(limit: int | str | None, what: str = "PipelineConfig.memory_limit") -> int | None:
    """A memory limit as bytes: an int > 0, a size text ("40GiB", "512 MiB"), or None; ValueError otherwise."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise ValueError(f"{what} must be bytes (an int) or a size such as '40GiB', got {limit!r}")
    if isinstance(limit, int):
        if limit < 1:
            raise ValueError(f"{what} must be >= 1 byte, got {limit}")
        return limit
    try:
        return parse_bytes(limit)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def check_options(options: dict[str, Any]) -> None:
    """Raise ValueError naming keys of schedule_options that schedule="auto" does not take."""
    known = PLAN_KEYS + PROFILE_KEYS + CALIBRATION_KEYS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"schedule='auto' takes schedule_options {', '.join(known)}; got unknown {unknown}")


def check_fixed(config: Any) -> None:
    """Raise ValueError when a PipelineConfig field fixes a choice that its schedule_options key would widen."""
    for name, key in FIXED.items():
        value = getattr(config, name)
        if value is not None and key in config.schedule_options:
            raise ValueError(f"schedule='auto': PipelineConfig.{name}={value!r} fixes what schedule_options[{key!r}] "
                             f"would let the planner choose from; set one of them")


@dataclass(frozen=True)
class RunPlan:
    """What a Pipeline runs: the schedule, M, ZeRO stage and gradient compression (and what auto predicted)."""

    schedule: str
    """The schedule, as the planner names it (with its options, e.g. "interleaved-1f1b(chunks=2)")."""
    microbatches: int
    """M."""
    zero_stage: int
    """The ZeRO stage (PipelineConfig.zero_stage it runs with)."""
    grad_compression: Options
    """The gradient compression (PipelineConfig.grad_compression it runs with)."""
    predicted_step_s: float | None = None
    """schedule="auto": the planner's predicted step time; None otherwise."""

    @property
    def compression(self) -> str:
        """The compression's name with its non-default options ("none", "powersgd(rank=1)")."""
        return options_label(self.grad_compression)

    def summary(self) -> str:
        """One line: "zbv, M=8, ZeRO 0, gradient compression none (predicted step 12.3 ms)"."""
        text = (f"{self.schedule}, M={self.microbatches}, ZeRO {self.zero_stage}, gradient compression "
                f"{self.compression}")
        if self.predicted_step_s is None:
            return text
        return f"{text} (predicted step {self.predicted_step_s * 1e3:.4g} ms)"


@dataclass(frozen=True)
class AutoChoice:
    """What schedule="auto" decided, the same on every rank."""

    result: PlanResult
    """The planner's result: every candidate, best first (`result.table()`)."""
    profile: Profile
    """Rank 0's profile of the given parts (with the calibrated runtime work when the calibration ran)."""
    schedule: Schedule
    """The winner, ready to run."""
    groups: tuple[int, ...]
    """How many of the given parts each of the schedule's model parts holds (contiguous, in order)."""
    plan: RunPlan
    """What runs: the winner's schedule, M, ZeRO stage and gradient compression."""
    source: str = ""
    """Where the measurements came from ("measured", "cache <file>", ...)."""

    def merged_parts(self, parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The given parts as the schedule's model parts: a run of several becomes one PartChain."""
        return merge_parts(parts, self.groups)

    def merged_init(self, init: PartInit | None) -> PartInit | None:
        """`init(part, k)` for the merged parts: each given part k inside a chain is filled by init(part, k)."""
        return merge_init(init, self.groups)

    def merged_partition(self, partition: Partition | None) -> Partition | None:
        """The given parts' Partition with the merged runs joined (None stays None)."""
        if partition is None:
            return None
        out, start = [], 0
        for g, count in enumerate(self.groups):
            run = partition.parts[start:start + count]
            times = [p.est_time_s for p in run]
            out.append(PartInfo(g, range(run[0].layers.start, run[-1].layers.stop), sum(p.num_params for p in run),
                                None if None in times else sum(t for t in times if t is not None),
                                run[0].has_embedding, run[-1].has_head))
            start += count
        return replace(partition, balance=tuple(len(p.layers) for p in out), parts=tuple(out))

    def applied(self, config: Any) -> Any:
        """`config` (a PipelineConfig) with the plan's M, ZeRO stage and gradient compression set (and the
        schedule_options that searched them dropped): what runs."""
        p = self.plan
        options = {k: v for k, v in config.schedule_options.items() if k not in FIXED.values()}
        return replace(config, num_microbatches=p.microbatches, zero_stage=p.zero_stage,
                       grad_compression=p.grad_compression, schedule_options=options)

    def summary(self) -> str:
        """The choice in one line."""
        best = self.result.best
        cap = self.result.config.memory
        limit = "no memory limit" if cap >= NO_LIMIT else f"limit {format_bytes(cap)} per rank"
        return (f"schedule='auto' chose {self.plan.summary()}; {limit}, peak {format_bytes(best.peak_bytes)} per rank; "
                f"the model's {self.profile.num_parts} parts run as {len(self.groups)} (merged {list(self.groups)}); "
                f"measurements: {self.source or 'measured'}")


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


@dataclass(frozen=True)
class AutoSetup:
    """Where and with what schedule="auto" plans (built by `Pipeline`)."""

    ranks: int
    """P."""
    dp: int
    """D."""
    pp_rank: int
    """This process's pipeline rank."""
    device: torch.device
    """Where the parts run."""
    init: PartInit | None = None
    """init(part, k) for parts on the meta device."""
    autocast: torch.dtype | None = None
    """The precision's autocast dtype."""
    build: PipelineBuilder | None = None
    """Builds the calibration's Pipelines (None: no in-pipeline calibration)."""


def _profile(parts: Sequence[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor], sample: tuple[Any, Any],
             microbatches: int, kwargs: dict[str, Any], setup: AutoSetup) -> Profile:
    """Profile copies of the parts on the sample's first of `microbatches` microbatches (as the runtime splits it)."""
    inputs, targets = sample
    first = split(inputs, microbatches, "sample_input")[0]
    target = split(targets, microbatches, "sample_targets")[0] if targets is not None else None
    copies = [materialize_part(parts, k, setup.device, setup.init) for k in range(len(parts))]
    move = (lambda t: t.to(setup.device))  # noqa: E731
    first = map_leaves(move, first)
    target = map_leaves(move, target) if target is not None else None
    loss = loss_fn if target is not None else None
    with _autocast(setup.device, setup.autocast):
        if "evict_bytes" not in kwargs:  # as many bytes as one microbatch keeps through the model, at least 2 x L2
            sizes = profile_parts(copies, first, target=target, loss_fn=loss, repeats=1, warmup=0, fit_rows=0,
                                  fused=False, timer=time.perf_counter)
            kwargs = {**kwargs, "evict_bytes": max(cache_evict_bytes(), sum(p.activation_bytes for p in sizes.parts))}
        return profile_parts(copies, first, target=target, loss_fn=loss, meta={"source": "schedule='auto'"}, **kwargs)


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


def probe_optimizer(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer | None:
    """What `optimizer` builds on one parameter (its type and hyperparameters), or None when it cannot."""
    try:
        return optimizer([nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - an optimizer that needs the real parameters: checked when it is built
        return None


def trainer_refusal(config: Any, probe: torch.optim.Optimizer | None, parts: Sequence[nn.Module],
                    dp: int) -> Callable[[int, Options], str | None]:
    """The trainer's rule for a (ZeRO stage, compression) pair under `config`: PipelineConfig's own checks
    (ZeRO with the method, ZeroOptions, dp_strategy, clipping with DGC), the sparsifiers' optimizer checks on
    the optimizer `probe` (`probe_optimizer`; None: not checked here), and ZeRO with tied weights. Returns why
    it refuses the pair (its first line), or None."""
    tied = [t.places for t in find_tied(parts)]

    def rule(zero: int, options: Options) -> str | None:
        try:
            replace(config, schedule="1f1b", schedule_options={}, memory_limit=None, num_microbatches=None,
                    zero_stage=zero, grad_compression=options)
            if probe is not None:
                check_optimizer(options, probe)
                check_dgc_momentum(options, probe)
            check_tied(zero, tied, dp)
        except ValueError as exc:
            return str(exc).splitlines()[0]
        return None
    return rule


def calibration_config(config: Any, schedule: Schedule) -> Any:
    """The PipelineConfig of a calibration run: `config`'s runtime settings on `schedule`, without data-parallel
    compression or ZeRO (the planner models those itself) and without the replica check."""
    return replace(config, schedule=schedule, num_microbatches=None, schedule_options={}, memory_limit=None,
                   zero_stage=0, grad_compression=None, dp_strategy=None, zero=ZeroOptions(), check_replicas=False)


def _plan_config(config: Any, options: dict[str, Any], rows: int, setup: AutoSetup,
                 refusal: Callable[[int, Options], str | None]) -> PlanConfig:
    """The planner's settings: schedule_options, with the fields the user fixed in `config` as the only choice."""
    values: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items() if k in PLAN_KEYS}
    if config.num_microbatches is not None:
        values["microbatches"] = (config.num_microbatches,)
    if config.zero_stage is not None:
        values["zero_stages"] = (config.zero_stage,)
    if config.grad_compression is not None:
        values["compressions"] = (compression_options(config.grad_compression),)
    cap = memory_bytes(config.memory_limit)
    return PlanConfig(ranks=setup.ranks, batch=rows * setup.dp, memory=cap if cap is not None else NO_LIMIT,
                      dp=setup.dp, refusal=refusal, **values)


def _fingerprint(parts: Sequence[nn.Module], sample: tuple[Any, Any], config: Any, setup: AutoSetup,
                 profile_kwargs: dict[str, Any], rows: tuple[int, ...], calibration: Calibration,
                 optimizer_type: str) -> dict[str, Any]:
    """What the cached measurements depend on: the parts, the sample, P and D, the machine, the runtime's settings."""
    return {"parts": parts_digest(parts), "sample": sample_signature(sample[0]),
            "targets": sample_signature(sample[1]), "ranks": setup.ranks, "dp": setup.dp,
            "device": setup.device.type, "machine": machine_signature(), "precision": config.precision,
            "activation_checkpointing": repr(config.activation_checkpointing),
            "p2p_compression": repr(config.p2p_compression), "count_saved_bytes": config.count_saved_bytes,
            "record_timeline": config.record_timeline, "check_inputs": config.check_inputs_every_step,
            "optimizer": optimizer_type, "profile": {k: _name(v) for k, v in profile_kwargs.items()},
            "profile_rows": list(rows), "calibration": [calibration.enabled, calibration.budget_s]}


def _name(value: Any) -> str:
    """A setting as the cache key sees it: a callable (a timer) by its name, anything else by its repr."""
    return getattr(value, "__qualname__", type(value).__qualname__) if callable(value) else repr(value)


def _settings(options: dict[str, Any]) -> tuple[Calibration, Any]:
    """The calibration settings and the cache (None: no cache) of schedule_options. A scripted timer means a
    test or a custom measurement: no cache unless one is named."""
    scripted = "timer" in options or "cpu_timer" in options
    cache = cache_of(options.get("calibration_cache", None if scripted else default_cache_dir()))
    calibration = Calibration(bool(options.get("calibrate", True)), float(options.get("calibration_budget_s", 3.0)),
                              options.get("cpu_timer", time.process_time))
    return calibration, cache


def choose(parts: Sequence[nn.Module] | Callable[[int], nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor],
           optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], config: Any, setup: AutoSetup,
           sample: tuple[Any, Any] | None) -> AutoChoice:
    """Measure (cached), plan for P x D and the sample's batch size, log the choice once (rank 0).

    `sample` is (inputs, targets) of one step's batch on this replica. The profile is rank 0's, on the
    sample's largest candidate microbatch (affine down to the smallest), and the calibration trains
    `calibration_runs` with the real parts on every rank (`setup.build`). Fields the user set in `config`
    (num_microbatches, zero_stage, grad_compression) are the planner's only choice for them. Raises
    ValueError on every rank, before any training, when the parts or the sample are unusable or no
    candidate fits the limit (naming the smallest feasible cap).
    """
    options = dict(config.schedule_options)
    check_options(options)
    if as_factory(parts) is not None:
        raise ValueError("schedule='auto' needs the model parts as a list (it merges neighbouring parts for the "
                         "chosen schedule); got a part factory")
    given = list(parts)  # type: ignore[arg-type]
    if sample is None or sample[0] is None:
        raise ValueError("schedule='auto' profiles the model on a sample: pass sample_input= (a batch as given to "
                         "step) and sample_targets= to the Pipeline")
    rows = int(flatten(sample[0], "sample_input")[1][0].shape[0])
    probe = probe_optimizer(optimizer)
    refusal = trainer_refusal(config, probe, given, setup.dp)
    plan_config = _plan_config(config, options, rows, setup, refusal)
    counts = microbatch_counts(plan_config)
    measured = sorted(set(counts) | set(microbatch_counts(replace(plan_config, microbatches=None))))
    small, large = rows // max(measured), rows // min(measured)
    kwargs = {"fit_rows": small if 1 <= small < large else 0, **{k: options[k] for k in PROFILE_KEYS if k in options}}
    calibration, cache = _settings(options)

    def measure() -> Profile:
        profile = _shared_profile(lambda: _profile(given, loss_fn, sample, min(measured), kwargs, setup))
        if not calibration.enabled or setup.build is None:
            return profile
        fitted, samples, walls = calibrate(profile, given, setup.init, sample, ranks=setup.ranks,
                                           pp_rank=setup.pp_rank, counts=measured, build=setup.build,
                                           settings=calibration)
        meta = dict(profile.meta, calibration_walls=walls,
                    calibration_samples=[[s.actions, s.messages, s.seconds, s.compute] for s in samples])
        if isinstance(fitted, str):
            LOGGER.warning("schedule='auto': the in-pipeline calibration could not separate its terms (%s); "
                           "planning without the runtime's work", fitted)
            return replace(profile, meta=meta)
        if "p2p_link" not in options:
            message = max((p.output_bytes for p in profile.at_microbatch(rows / min(measured)).parts[:-1]),
                          default=4)
            meta["p2p_link"] = list(measure_link(setup.pp_rank, int(message)))
        return replace(profile, overhead=fitted, meta=meta)

    fingerprint = _fingerprint(given, sample, config, setup, kwargs, (small, large), calibration, type(probe).__name__)
    profile, source = cached_profile(cache, fingerprint, measure)
    if "p2p_link" not in options:
        plan_config, note = _measured_link(profile, plan_config)
        source = f"{source}; {note}" if note else source
    profile, note = _wall_scaled(profile, plan_config)
    return _decide(profile, plan_config, f"{source}; {note}" if note else source)


def _wall_scaled(profile: Profile, config: PlanConfig) -> tuple[Profile, str]:
    """The profile with the calibration runs' measured over modelled wall time (`fit_wall_scale`, under this
    plan's cores and link) as its wall_scale; unchanged without a calibration or when that factor is beyond
    [1/MAX_SCALE, MAX_SCALE] (a disturbed measurement)."""
    walls = profile.meta.get("calibration_walls")
    if profile.overhead is None or not walls:
        return profile, ""
    factor = fit_wall_scale(profile, config, [(str(n), int(m), float(w)) for n, m, w in walls])
    if not 1 / MAX_SCALE <= factor <= MAX_SCALE:
        return profile, f"calibration walls {factor:.3g}x the model: not applied"
    return (replace(profile, overhead=replace(profile.overhead, wall_scale=factor)),
            f"walls {factor:.3g}x the model of the machine (calibration runs)")


def _measured_link(profile: Profile, config: PlanConfig) -> tuple[PlanConfig, str]:
    """`config` with the stage-to-stage link the calibration measured (round trips), if it did."""
    link = profile.meta.get("p2p_link")
    if not (isinstance(link, list) and len(link) == 2):
        return config, ""
    latency, bandwidth = float(link[0]), float(link[1])
    return (replace(config, p2p_link=Link(bandwidth=bandwidth, latency=latency)),
            f"link {latency * 1e6:.0f} us per message" + (f", {bandwidth / 1e9:.3g} GB/s" if bandwidth < 1e15 else ""))


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
    run = RunPlan(best.schedule, best.microbatches, best.zero, method.options or NoCompression(), best.step_s)
    choice = AutoChoice(result, profile, schedule, tuple(profile.group_sizes(schedule.num_groups)), run, source)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        LOGGER.info("%s\n%s", choice.summary(), result.table())
    return choice
