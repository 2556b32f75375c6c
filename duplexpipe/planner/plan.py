"""The planner: for a measured Profile, rank schedule x microbatches x ZeRO stage (ZeRO-3 with its residency window) x
activation checkpointing x compression under a byte cap (for one P x D x T mesh; `world.plan_world` compares the
meshes of a world size)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from duplexpipe.dp_options.compression import Options
from duplexpipe.errors import PlanError, ProfileError, ScheduleError
from duplexpipe.planner.candidates import (
    CHECKPOINTING,
    Candidate,
    accepted,
    candidates,
    checkpointing_policy,
    compressions,
    planned_offloads,
    planned_policies,
    runtime_checkpointing,
    schedule_label,
    zero_stages,
)
from duplexpipe.planner.dp_comm import (
    COMPRESSIONS,
    Compression,
    Link,
    exposed_time,
    reduction_time,
    zero_stage,
)
from duplexpipe.planner.host_offload import OFFLOAD_FRACTIONS, check_fraction, copy_time, moves, offload_label
from duplexpipe.planner.levers import checkpointed, checkpointed_label
from duplexpipe.planner.machine import Machine, simulate_shared
from duplexpipe.planner.memory import (
    GLOO_RECEIVES_AHEAD,
    MemoryConfig,
    RankMemory,
    StageBytes,
    rank_memory,
    state_bytes,
)
from duplexpipe.planner.profile import PartProfile, Profile
from duplexpipe.planner.tp_comm import DEFAULT_TP_BANDWIDTH, local_profile, tp_refusal
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.shard import add_unshard_reshard, episodes, grad_reductions, windows_gradients
from duplexpipe.schedules.simulate import FSDP_LANE, CostModel, simulate
from duplexpipe.schedules.timeline import Timeline
from duplexpipe.sizes import format_bytes

HIDDEN = 1e-9
"""Exposed data-parallel time (s) at or below which a reduction counts as hidden."""
WORTH_IT = 0.01
"""When no compression hides the reduction, a heavier method must shorten the step by more than this
fraction to be chosen over a lighter one."""


@dataclass(frozen=True)
class PlanConfig:
    """What to plan for."""

    ranks: int
    """P: pipeline ranks per data-parallel replica."""
    batch: int
    """Global batch per step, in samples (split over the D replicas, then into M microbatches)."""
    memory: int
    """The cap: bytes each rank may use."""
    dp: int = 1
    """D: data-parallel replicas (P x D processes)."""
    schedules: tuple[str, ...] | None = None
    """Registry names to consider (None: every built-in and auto)."""
    microbatches: tuple[int, ...] | None = None
    """M values to try (None: the divisors of batch / D from P to 8P, else all up to 8P)."""
    chunks: tuple[int, ...] = (2, 4)
    """Chunks per rank tried for interleaved-1f1b."""
    zero_stages: tuple[int, ...] | None = None
    """ZeRO stages to try (None: every stage the trainer has, `dp_options.ZERO_STAGES`). With D = 1 they are
    one plan (nothing is sharded): only the lowest is shown."""
    compressions: tuple[str | Options, ...] | None = None
    """Gradient compressions allowed: names of `dp_comm.COMPRESSIONS` ("powersgd", "powersgd(rank=1)") or the
    trainer's options objects (None: the whole table); each plan uses the lightest that hides, among those the
    trainer accepts with its ZeRO stage (`refusal`)."""
    refusal: Callable[[int, Options], str | None] | None = field(default=None, compare=False, repr=False)
    """The trainer's rule for a (ZeRO stage, compression options) pair: why it refuses the pair, or None when it
    runs it. None: `dp_options.zero_refusal` (ZeRO's own rule, default ZeroOptions); `Pipeline` passes its
    whole configuration's check. Refused pairs are never planned."""
    dp_link: Link = field(default_factory=Link)
    """The data-parallel link (bandwidth and latency)."""
    p2p_link: Link = field(default_factory=Link)
    """The link between pipeline neighbours."""
    optimizer_factor: float = 2.0
    """Optimizer-state bytes per parameter byte (AdamW: 2)."""
    gradient_factor: float = 1.0
    """Gradient bytes per parameter byte."""
    cores: float | None = None
    """Cores shared by the P x T processes of one data-parallel replica (None: a device per rank). Set, the step
    is simulated with processor sharing (`machine.simulate_shared`) on C / T of them (each TP rank of a stage
    runs the same work): k ranks with work each run at min(1, C / (T k)). Set, the ranks are CPU processes over
    gloo, whose sends the byte model holds until a reply proves them received and whose receives it posts ahead
    (`MemoryConfig.sends_held`, `receives_ahead`)."""
    tp: int = 1
    """T: tensor-parallel degree inside each stage (P x D x T processes); T > 1 needs a profile taken with the
    TP plan (`Profile.tp_degrees`, `PartProfile.tp`), priced by `tp_comm`."""
    tp_link: Link = field(default_factory=lambda: Link(DEFAULT_TP_BANDWIDTH))
    """The link between the ranks of a TP group (default `tp_comm.DEFAULT_TP_BANDWIDTH`, no latency)."""
    sequence_parallel: bool = False
    """Sequence parallelism under TP: activations and stage-to-stage messages hold 1/T of the sequence."""
    reshard_windows: tuple[int | None, ...] = (1, None)
    """ZeRO-3's residency windows to try, in stages kept unsharded at once (None: all of a rank's stages; a window
    at or above a schedule's stages per rank is the same plan as None). A window below all is tried only where
    the candidate with all of them is over the cap."""
    checkpointing: tuple[bool | str, ...] = CHECKPOINTING
    """Activation-checkpointing policies to try (`candidates.CHECKPOINTING`): "off" (or False); "selective", every
    stage under the runtime's selective policy, with the bytes and recompute the profile measured (planned only
    where every part has them: `PartProfile.selective_activation_bytes`); "full" (or True), every stage keeping its
    inputs only, its backward running the forward once more. A policy is tried only where the candidate with the
    next lighter one (full -> selective -> off) is over the cap."""
    host_link: Link | None = None
    """The copy link between a rank's device and host memory (bandwidth, latency), what activation offload moves
    its saved tensors over; None (unknown, the default): offload is never planned."""
    offload: tuple[bool | float, ...] = OFFLOAD_FRACTIONS
    """Activation offloads to try where `host_link` is known (`PipelineConfig.activation_offload`'s values: a
    fraction 0 < f < 1 of the live forwards, True all but the one whose backward is next; a fraction of 1 is
    planned as True), each only where the next smaller one is over the cap (and before checkpointing is tried:
    a policy is tried only where the same offload without it is over the cap)."""


@dataclass(frozen=True)
class PlanRow:
    """One candidate: a schedule (with options), M, ZeRO stage and compression, and what it costs."""

    schedule: str
    """Registry name, with options, e.g. "interleaved-1f1b(chunks=2)" or "auto(v)"."""
    microbatches: int
    """M."""
    zero: int
    """ZeRO stage."""
    compression: str = "-"
    """The lightest allowed gradient compression that hides the reduction (or the fastest if none does)."""
    step_s: float = math.nan
    """Predicted step time: the makespan plus DualPipe's mirror sum and any exposed reduction."""
    makespan_s: float = math.nan
    """Simulated pipeline makespan."""
    bubble: float = math.nan
    """Simulated bubble ratio."""
    dp_exposed_s: float = math.nan
    """Reduction (and mirror-sum) time not hidden behind compute."""
    peak_bytes: float = math.nan
    """The largest per-rank peak of the byte model."""
    memory: tuple[RankMemory, ...] = ()
    """Per rank."""
    rejected: str = ""
    """Why it is out ("" when it fits)."""
    ranks: int = 1
    """P of its mesh."""
    dp: int = 1
    """D of its mesh."""
    tp: int = 1
    """T of its mesh (the TP degree inside each stage)."""
    window: int | None = None
    """ZeRO-3's residency window in stages (None: all of a rank's stages, or not ZeRO-3)."""
    checkpointing: str = "off"
    """Activation checkpointing of every stage: "off", "selective" or "full" (`candidates.CHECKPOINTING`)."""
    offload: bool | float = False
    """Activation offload (`PipelineConfig.activation_offload`'s value): False, a fraction, or True."""
    offload_s: float = 0.0
    """What the offload's copies add to the step (in `step_s`): beyond the compute each overlaps."""

    @property
    def activation_checkpointing(self) -> bool | str:
        """`PipelineConfig.activation_checkpointing`'s value that runs this plan: False, "selective" or True."""
        return runtime_checkpointing(self.checkpointing)

    @property
    def zero_label(self) -> str:
        """The ZeRO stage, with ZeRO-3's window: "2", "3/all", "3/w1"."""
        if self.zero != 3:
            return str(self.zero)
        return "3/all" if self.window is None else f"3/w{self.window}"

    @property
    def label(self) -> str:
        """The plan in a few words: "zbv M=8 ZeRO 3/w1, checkpointed" ("selectively checkpointed")."""
        return f"{self.schedule} M={self.microbatches} ZeRO {self.zero_label}" + \
            checkpointed_label(self.checkpointing) + \
            ("" if self.offload is False else f", offload {offload_label(self.offload)}")

    @property
    def over_cap(self) -> bool:
        """True when it was rejected only for its peak memory."""
        return self.rejected.startswith("peak ")

    @property
    def mesh(self) -> str:
        """"PxDxT", e.g. "2x1x2"."""
        return f"{self.ranks}x{self.dp}x{self.tp}"

    @property
    def feasible(self) -> bool:
        """True when nothing rejected it."""
        return not self.rejected

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (NaN as None)."""
        out: dict[str, Any] = {"schedule": self.schedule, "microbatches": self.microbatches, "zero": self.zero,
                               "compression": self.compression, "pp": self.ranks, "dp": self.dp, "tp": self.tp,
                               "reshard_window": self.window,
                               "activation_checkpointing": self.activation_checkpointing,
                               "activation_offload": self.offload, "offload_s": self.offload_s,
                               "rejected": self.rejected or None}
        for key in ("step_s", "makespan_s", "bubble", "dp_exposed_s", "peak_bytes"):
            value = getattr(self, key)
            out[key] = None if math.isnan(value) else value
        out["per_rank"] = [m.to_dict() for m in self.memory]
        return out


@dataclass(frozen=True)
class PlanResult:
    """Every candidate, best first; the feasible ones ranked by predicted step time."""

    config: PlanConfig
    """What was planned for."""
    rows: tuple[PlanRow, ...]
    """Feasible rows by step time, then rejected ones."""
    advice: str
    """One line on the data-parallel reduction of the best plan (empty when D = 1)."""
    schedule: Schedule | None = field(default=None, repr=False, compare=False)
    """The best plan's schedule, ready to run (`Pipeline` / `PipelineRuntime` take a Schedule)."""
    world: int | None = None
    """The world size whose P x D x T meshes were compared (`world.plan_world`); None: the one mesh of `config`."""
    decided: str = ""
    """Which constraint decided, in one line: "time: ..." when the fastest candidate fits the cap, else "memory:
    <the fastest> needs X > cap; <the best> fits at Y, +Z% step"."""

    @property
    def best(self) -> PlanRow:
        """The fastest plan that fits the cap."""
        return self.rows[0]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        c = self.config
        return {"ranks": c.ranks, "dp": c.dp, "tp": c.tp, "world": self.world, "batch": c.batch,
                "memory_bytes": c.memory, "sequence_parallel": c.sequence_parallel,
                "tp_bandwidth": c.tp_link.bandwidth, "tp_latency": c.tp_link.latency, "best": self.best.to_dict(),
                "advice": self.advice, "decided": self.decided, "candidates": [r.to_dict() for r in self.rows]}

    def table(self, limit: int | None = None) -> str:
        """The candidates as fixed-width text, best first (at most `limit` rows)."""
        head = (f"{'schedule':<26} {'M':>4} {'ZeRO':>5} {'compression':<16} {'PxDxT':>7} {'ckpt':>9} {'offload':>7} "
                f"{'step':>10} {'bubble':>7} {'peak/rank':>10}  why rejected")
        lines = [head]
        for row in self.rows[:limit]:
            step = _time(row.step_s) if not math.isnan(row.step_s) else "-"
            peak = format_bytes(row.peak_bytes) if not math.isnan(row.peak_bytes) else "-"
            bubble = f"{row.bubble:.1%}" if not math.isnan(row.bubble) else "-"
            lines.append(f"{row.schedule:<26} {row.microbatches:>4} {row.zero_label:>5} {row.compression:<16} "
                         f"{row.mesh:>7} {row.checkpointing:>9} {offload_label(row.offload):>7} {step:>10} {bubble:>7} "
                         f"{peak:>10}  {row.rejected}".rstrip())
        return "\n".join(lines)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def plan(profile: Profile, config: PlanConfig) -> PlanResult:
    """Simulate every candidate with the profile's costs, drop those over the cap, rank by step time.

    Raises PlanError for settings that allow no candidate, a profile with fewer parts than
    ranks, or a cap below every candidate (naming the smallest feasible cap).
    """
    check(profile, config)
    return ranked(evaluate(profile, config), config)


Evaluated = tuple["PlanRow", "_Context | None"]
"""A candidate's row and what it was computed from (None when it could not be simulated)."""


def evaluate(profile: Profile, config: PlanConfig) -> list[Evaluated]:
    """Every candidate of `config` (checked by `check`), evaluated; a memory lever (checkpointing, ZeRO-3 over the
    highest other stage, a window below all: `Candidate.lighter`) only where the candidate without it is over the
    cap, a ZeRO-3 window only below the schedule's stages per rank."""
    methods = {zero: accepted(config, zero) for zero in zero_stages(config)}
    below = max((zero for zero in methods if zero < 3), default=None)
    policies, offloads = planned_policies(profile, config), planned_offloads(config)
    done: dict[Any, PlanRow] = {}
    out: list[Evaluated] = []
    for candidate in candidates(profile, config):
        lighter = candidate.lighter(below, policies, offloads)
        if lighter is not None and not (lighter.key in done and done[lighter.key].over_cap):
            continue
        evaluated = _evaluate(profile, config, candidate, methods[candidate.zero])
        if evaluated is not None:
            done[candidate.key] = evaluated[0]
            out.append(evaluated)
    return out


def ranked(evaluated: Sequence[Evaluated], config: PlanConfig, world: int | None = None) -> PlanResult:
    """The result: feasible rows by step time (ties: lower ZeRO stage, smaller peak, lower TP degree), then the
    rejected ones; `config` is the best row's. PlanError when nothing fits (naming the smallest feasible cap)."""
    rows = [row for row, _ in evaluated]
    fits = sorted((e for e in evaluated if e[0].feasible),
                  key=lambda e: (e[0].step_s, e[0].zero, e[0].peak_bytes, e[0].tp, e[0].dp, e[0].schedule))
    if not fits:
        raise _nothing_fits(rows, config)
    best, context = fits[0]
    assert context is not None
    out = [row for row, _ in fits] + [r for r in rows if not r.feasible]
    return PlanResult(context.config, tuple(out), _advice(context.config, best, context), context.schedule, world,
                      decided(rows, best, config.memory) + policy_note(rows, best, config) +
                      offload_note(rows, best, config))


def decided(rows: Sequence[PlanRow], best: PlanRow, cap: float) -> str:
    """Which constraint chose `best` among `rows`: time when no candidate over the cap is as fast, else memory
    (naming the fastest candidate, its need, and what `best` costs beside it: a lever whose cost hides, +0%)."""
    over = [r for r in rows if r.over_cap and r.step_s <= best.step_s]
    if not over:
        return f"time: {best.label} is the fastest candidate and fits (peak {format_bytes(best.peak_bytes)})"
    fast = min(over, key=lambda r: (r.step_s, r.peak_bytes))
    slower = best.step_s / fast.step_s - 1 if fast.step_s > 0 else 0.0
    return (f"memory: {fast.label} needs {format_bytes(fast.peak_bytes)} > {format_bytes(cap)}; {best.label} fits "
            f"at {format_bytes(best.peak_bytes)}, {slower:+.0%} step")


def check(profile: Profile, config: PlanConfig) -> None:
    """PlanError for settings that allow no candidate, or a profile that cannot be planned on `config`'s mesh."""
    for name in ("ranks", "batch", "memory", "dp", "tp"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"plan needs {name} as an integer >= 1, got {value!r}")
    if config.cores is not None and (not isinstance(config.cores, (int, float)) or isinstance(config.cores, bool)
                                     or not 0 < config.cores < math.inf):
        raise PlanError(f"plan needs cores as a number > 0 or None (a device per rank), got {config.cores!r}")
    why = tp_refusal(profile, config.tp)
    if why:
        raise PlanError(why)
    if config.batch % config.dp:
        raise PlanError(f"batch {config.batch} does not split over dp={config.dp} replicas")
    if profile.num_parts < config.ranks:
        raise PlanError(f"the profile has {profile.num_parts} parts, but {config.ranks} ranks need at least "
                        f"{config.ranks} (one per rank); profile the model split into more parts")
    for name in config.schedules or ():
        registry.entry(name)
    for stage in config.zero_stages or ():
        zero_stage(stage)
    for window in config.reshard_windows:
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise PlanError(f"plan needs reshard windows as integers >= 1 or None (all stages), got {window!r}")
    if not config.reshard_windows or not config.checkpointing:
        raise PlanError(f"plan needs at least one reshard window and one checkpointing policy, got "
                        f"{config.reshard_windows!r} and {config.checkpointing!r}")
    for policy in config.checkpointing:
        checkpointing_policy(policy)
    for value in config.offload:
        try:
            check_fraction(value)
        except ValueError as exc:
            raise PlanError(f"plan needs {exc}") from None
    if not planned_policies(profile, config):
        raise PlanError("plan allows only selective checkpointing, but the profile has no selective-checkpointing "
                        "figures; profile the parts again (profile_parts measures them) or allow off or full")
    compressions(config)


@dataclass(frozen=True)
class _Context:
    """What a candidate's row was computed from (kept for the advice line)."""

    schedule: Schedule
    timeline: Timeline
    groups: tuple[PartProfile, ...]
    config: PlanConfig
    sharded: Schedule | None = None
    """ZeRO-3: the schedule with its UNSHARD / RESHARD / REDUCE_GRAD actions."""


def _evaluate(profile: Profile, config: PlanConfig, candidate: Candidate,
              methods: tuple[list[Compression], list[str]]) -> tuple[PlanRow, _Context | None] | None:
    """One candidate's row (rejected with a reason when it cannot run or does not fit), None for a ZeRO-3 window
    at or above the schedule's stages per rank (the same plan as window None); `methods`: the compressions the
    trainer accepts with its ZeRO stage, and why it refuses the others."""
    name, options, m, zero = candidate.schedule, candidate.options, candidate.microbatches, candidate.zero
    reject = PlanRow(schedule_label(name, options), m, zero, ranks=config.ranks, dp=config.dp, tp=config.tp,
                     window=candidate.window, checkpointing=candidate.checkpointing, offload=candidate.offload)
    local = config.batch // config.dp
    if local % m:
        return _why(reject, f"batch/D = {local} does not split into {m} microbatches"), None
    if not methods[0]:
        return _why(reject, f"the trainer refuses ZeRO {zero} with every allowed compression "
                            f"({'; '.join(methods[1])})"), None
    reason = registry.check(name, config.ranks, m, **options) if name != "auto" else None
    if reason:
        return _why(reject, reason), None
    scaled = local_profile(profile.at_microbatch(local / m), config.tp, config.tp_link, config.sequence_parallel)
    # ranks sharing CPU cores talk over gloo: sends held until a reply proves them received, receives posted ahead
    gloo = config.cores is not None
    mem_config = MemoryConfig(config.optimizer_factor, config.gradient_factor, zero, config.dp, sends_held=gloo,
                              receives_ahead=GLOO_RECEIVES_AHEAD if gloo else 0, offload=candidate.offload)
    excess = [0.0] * config.ranks
    sharded = None
    for _ in range(2 if name == "auto" else 1):  # auto: once more with the overshoot taken off its budget
        try:
            schedule, groups, recompute = _build(scaled, profile, config, candidate, mem_config, excess)
        except (ProfileError, ScheduleError, ValueError) as exc:
            return _why(reject, str(exc).splitlines()[0]), None
        if candidate.window is not None and candidate.window >= _most_stages(schedule):
            return None
        cost = _cost_model(schedule, groups, config.p2p_link)
        timeline, tail = _simulate(schedule, cost, groups, profile, config)
        if zero_stage(zero).shard_params:
            sharded = add_unshard_reshard(schedule, candidate.window or _most_stages(schedule), dp=config.dp)
            tail += gather_time(schedule, sharded, cost, groups, config)
        sizes = StageBytes.of(schedule, groups, recompute)
        memory = rank_memory(sharded or schedule, timeline, sizes, mem_config)
        excess = [e + max(0.0, r.peak - config.memory) for e, r in zip(excess, memory, strict=True)]
        if max(r.peak for r in memory) <= config.memory:
            break
    peak = max(r.peak for r in memory)
    copies = 0.0
    if candidate.offload is not False and config.host_link is not None:
        copies = copy_time(moves(timeline, candidate.offload), sizes.activation, config.host_link, config.ranks)
        tail += copies
    method, step = _choose_compression(schedule, timeline, groups, config, zero, methods[0])
    step += tail
    row = replace(reject, compression=method.name, step_s=step, makespan_s=timeline.makespan,
                  bubble=timeline.bubble_ratio, dp_exposed_s=step - timeline.makespan - copies, peak_bytes=peak,
                  memory=tuple(memory), offload_s=copies)
    context = _Context(schedule, timeline, groups, config, sharded)
    if peak > config.memory:
        return _why(row, f"peak {format_bytes(peak)} > cap {format_bytes(config.memory)}"), context
    return row, context


def _simulate(schedule: Schedule, cost: CostModel, groups: Sequence[PartProfile], profile: Profile,
              config: PlanConfig) -> tuple[Timeline, float]:
    """The timeline, and the time the ranks' per-step runtime work adds after it.

    Without shared cores, a measured runtime overhead or measured fused backward times: `simulate`
    (the plain model). Otherwise `contention.simulate_shared` on `config.cores` with the profile's
    overheads (compute actions scaled by its compute_scale), a B action costing its group's fused
    backward where every group has one.
    """
    fused = [g.backward_fused_s for g in groups]
    known = all(f is not None for f in fused)
    if config.cores is None and profile.overhead is None and not known:
        return simulate(schedule, cost), 0.0
    machine = Machine.of(config.cores / config.tp if config.cores is not None else None, profile.overhead)
    full = [groups[info.group].full_backward_s for info in schedule.stages] if known else None
    run = simulate_shared(schedule, cost, machine, full)
    return run.timeline, max(0.0, run.step - run.timeline.makespan)


def _why(row: PlanRow, reason: str) -> PlanRow:
    return replace(row, rejected=reason)


def _most_stages(schedule: Schedule) -> int:
    return max(len(schedule.stages_of_rank(r)) for r in range(schedule.num_ranks))


def gather_time(schedule: Schedule, sharded: Schedule, cost: CostModel, groups: Sequence[PartProfile],
                config: PlanConfig) -> float:
    """What ZeRO-3's collectives add to `schedule`'s step: `sharded` (its UNSHARD / RESHARD / REDUCE_GRAD form)
    simulated with each all-gather and reduce-scatter moving (D-1)/D of a stage's parameters (their mean over the
    stages) on the data-parallel link, from the first all-gather to the last collective, less `schedule`'s
    makespan under the same costs."""
    stages = [groups[info.group].param_bytes for info in schedule.stages]
    priced = replace(cost, param_bytes=float(sum(stages)) / len(stages), dp=config.dp,
                     dp_bandwidth=config.dp_link.bandwidth)
    plain = simulate(schedule, replace(priced, param_bytes=0.0)).makespan
    timeline = simulate(sharded, priced)
    lane = [s for s in timeline.spans if s.lane == FSDP_LANE]
    end = max([timeline.start + timeline.makespan] + [s.end for s in lane])
    start = min([timeline.start] + [s.start for s in lane])
    return max(0.0, end - start - plain)


def _build(profile: Profile, basis: Profile, config: PlanConfig, candidate: Candidate, mem_config: MemoryConfig,
           excess: Sequence[float]) -> tuple[Schedule, tuple[PartProfile, ...], tuple[int, ...]]:
    """The schedule, `profile` (scaled to the candidate's microbatch) grouped into its model parts,
    as `basis` (the profile as measured) groups them (`Profile.group_sizes` at the profiled size), checkpointed
    when the candidate says so, and per part its recompute's extra bytes (`checkpointed`; () without).

    auto is searched with each rank's activation budget: the cap minus its parameters,
    gradients and optimizer states, minus two of the largest messages in flight and
    `excess` (what an earlier try overshot by); never below the smallest limit auto accepts,
    so a cap that is too small still yields auto's leanest schedule (and its real peak).
    """
    name, options, m = candidate.schedule, candidate.options, candidate.microbatches

    def grouped(count: int) -> tuple[tuple[PartProfile, ...], tuple[int, ...]]:
        groups = profile.grouped(count, basis.group_sizes(count))
        return checkpointed(groups, candidate.checkpointing) if candidate.checkpointing != "off" else \
            (tuple(groups), ())

    if name != "auto":
        schedule = registry.build(name, config.ranks, m, **options)
        return (schedule, *grouped(schedule.num_groups))
    from duplexpipe.schedules.generators.auto import search_problem, smallest_limits

    placement = options["placement"]
    groups, recompute = grouped(config.ranks * (1 if placement == "linear" else 2))
    probe = registry.build("1f1b" if placement == "linear" else "zbv", config.ranks, m)
    sizes = StageBytes.of(probe, groups, recompute)
    cost = _cost_model(probe, groups, config.p2p_link)
    stage_memory = [float(a) for a in sizes.activation]
    floor = smallest_limits(search_problem(config.ranks, m, cost, None, placement, stage_memory))
    in_flight = 2 * max(max(sizes.output), max(sizes.output_grad))
    held = max(recompute, default=0)
    budget = [max(need, config.memory - static_bytes(probe, sizes, r, mem_config, candidate.window) - in_flight
                  - held - excess[r])
              for r, need in enumerate(floor)]
    options = {"cost": cost, "memory_limit": budget, "placement": placement, "stage_memory": stage_memory}
    return registry.build("auto", config.ranks, m, **options), groups, recompute


def static_bytes(schedule: Schedule, sizes: StageBytes, rank: int, config: MemoryConfig,
                 window: int | None = None) -> float:
    """Parameters, gradients and optimizer states of `rank` under `config` (bytes); under ZeRO-3 the parameters'
    1/D shards and the `window` largest stages unsharded (None: all of them), and with a window smaller than the
    rank's stages, where the pass windows the gradients (`shard.windows_gradients`), at most those stages' whole
    gradients beside every stage's 1/D reduced shard (it reduces after each episode, `shard.gradient_deltas`)."""
    mine = schedule.stages_of_rank(rank)
    params = float(sum(sizes.params[s] for s in mine))
    largest = sorted((float(sizes.params[s]) for s in mine), reverse=True)
    resident = sum(largest[:window] if window is not None else largest)
    windowed = window is not None and windows_gradients(len(mine), window, config.dp)
    grads = ((resident + params / config.dp) * config.gradient_factor
             if windowed and zero_stage(config.zero_stage).shard_params else None)
    return sum(state_bytes(params, resident, config, grads))


def _cost_model(schedule: Schedule, groups: Sequence[PartProfile], link: Link) -> CostModel:
    """Per-stage (F, B, W) seconds from the grouped profile; one message size: the largest."""
    table = {s: (groups[i.group].forward_s, groups[i.group].backward_s, groups[i.group].backward_weight_s)
             for s, i in enumerate(schedule.stages)}
    biggest = max(max(g.output_bytes, g.output_grad_bytes) for g in groups)
    return CostModel(stage_costs=table, latency=link.latency, bandwidth=link.bandwidth,
                     activation_bytes=float(biggest) if math.isfinite(link.bandwidth) else 0.0)


def _choose_compression(schedule: Schedule, timeline: Timeline, groups: Sequence[PartProfile],
                        config: PlanConfig, zero: int, allowed: Sequence[Compression]) -> tuple[Compression, float]:
    """The lightest allowed method that hides the reduction; if none does, the lightest within
    `WORTH_IT` of the fastest step (a heavier method must buy real time). Returns it and its step time."""
    passes = last_passes(timeline)
    floor = step_time(schedule, timeline, groups, replace(config, dp=1), zero, COMPRESSIONS["none"], passes)
    if config.dp == 1:  # nothing is reduced: every method takes the same time, the lightest is chosen
        return allowed[0], floor
    steps = [(method, step_time(schedule, timeline, groups, config, zero, method, passes)) for method in allowed]
    for method, step in steps:
        if step - floor <= HIDDEN:
            return method, step
    fastest = min(step for _, step in steps)
    return next((m, step) for m, step in steps if step <= fastest * (1 + WORTH_IT))


Passes = tuple[dict[int, float], dict[int, tuple[float, float]]]
"""Per rank its last event's end; per stage its last backward pass (B or W) as (start, end)."""


def last_passes(timeline: Timeline) -> Passes:
    """When each rank's list ends and each stage's last backward pass (B or W) runs, in `timeline`."""
    ends: dict[int, float] = {}
    last_pass: dict[int, tuple[float, float]] = {}
    for event in timeline.events:
        ends[event.rank] = max(ends.get(event.rank, 0.0), event.end)
        for part in event.action.compute_parts():
            if part.op in (Op.B, Op.W) and event.end >= last_pass.get(part.stage, (0.0, -1.0))[1]:
                last_pass[part.stage] = (event.start, event.end)
    return ends, last_pass


def step_time(schedule: Schedule, timeline: Timeline, groups: Sequence[PartProfile], config: PlanConfig,
              zero: int, method: Compression, passes: Passes | None = None) -> float:
    """The makespan, then per rank: DualPipe's mirror sum and the data-parallel reductions.

    Each stage's gradients (one bucket) become final during its last backward pass (its
    last W, or B); their reduction overlaps that pass (`dp_comm.exposed_time`), one stage
    after another on the rank's link. A mirrored schedule first exchanges the second copy's
    gradients with the mirror rank after its last pass, then reduces. `passes`: `last_passes(timeline)`
    (computed when not given).
    """
    ends, last_pass = passes if passes is not None else last_passes(timeline)
    step = timeline.makespan
    sharded = zero_stage(zero).shard_params  # ZeRO-3 reduces in the schedule (`gather_time`), not after it
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of_rank(rank)
        end = ends.get(rank, 0.0)
        mirror_bytes = sum(groups[schedule.stages[s].group].param_bytes * config.gradient_factor
                           for s in stages if schedule.copy_of_stage(s) > 0)
        if mirror_bytes:
            end += config.p2p_link.time(mirror_bytes)
        buckets = []
        for s in () if sharded else stages:
            params = groups[schedule.stages[s].group].param_bytes
            start, stop = (end, end) if schedule.num_copies > 1 else last_pass.get(s, (end, end))
            buckets.append((start, stop, reduction_time(params * config.gradient_factor, params, config.dp,
                                                        zero_stage(zero), method, config.dp_link)))
        step = max(step, end + exposed_time(buckets, end))
    return step


def _nothing_fits(rows: Sequence[PlanRow], config: PlanConfig) -> PlanError:
    sized = [r for r in rows if not math.isnan(r.peak_bytes)]
    if not sized:
        reasons = sorted({r.rejected for r in rows})
        return PlanError("no candidate can run: " + "; ".join(reasons[:3]))
    low = min(sized, key=lambda r: r.peak_bytes)
    cap = math.ceil(low.peak_bytes)
    return PlanError(f"no plan fits {format_bytes(config.memory)} per rank; the smallest feasible cap is "
                     f"{format_bytes(cap)} = {cap} bytes ({low.schedule}, M={low.microbatches}, ZeRO {low.zero_label}"
                     f"{checkpointed_label(low.checkpointing)}"
                     f"{'' if low.offload is False else ', offload ' + offload_label(low.offload)}, "
                     f"P x D x T = {low.mesh})", cap)


def _advice(config: PlanConfig, best: PlanRow, context: _Context) -> str:
    """Which compression method of the whole table is the lightest that hides the best plan's reduction (among
    those the trainer runs with the plan's ZeRO stage)."""
    if config.dp <= 1:
        return ""
    sched, timeline, groups = context.schedule, context.timeline, context.groups
    if context.sharded is not None:
        gathers, scatters = episodes(context.sharded), grad_reductions(context.sharded)
        busiest, scattering = (max(sum(n[s] for s in context.sharded.stages_of_rank(r)) for r in range(sched.num_ranks))
                               for n in (gathers, scatters))
        return (f"ZeRO-3 with window {best.window or 'all'}: the all-gathers (at most {busiest} per rank per step) "
                f"and the reduce-scatters (at most {scattering}) run in the schedule, "
                f"{best.dp_exposed_s * 1e3:.3g} ms beyond its compute")
    if sched.num_copies > 1:
        return (f"{sched.name} reduces its gradients over the data-parallel replicas after its mirror sum, when "
                f"no compute is left to hide behind: {best.dp_exposed_s * 1e3:.3g} ms with {best.compression}")
    floor = step_time(sched, timeline, groups, replace(config, dp=1), best.zero, COMPRESSIONS["none"])
    runs, _ = accepted(replace(config, compressions=None), best.zero)
    for method in runs:
        if step_time(sched, timeline, groups, config, best.zero, method) - floor <= HIDDEN:
            if method.name == "none":
                return "the data-parallel reduction hides behind the last backward passes without compression"
            note = "" if method.name in {c.name for c in compressions(config)} else " (not among the allowed)"
            return (f"lightest compression that hides the data-parallel reduction with ZeRO {best.zero}: "
                    f"{method.name} ({method.wire_ratio:g}x fewer bytes){note}")
    return f"no compression method the trainer runs with ZeRO {best.zero} hides the data-parallel reduction on " \
           "this link"


def policy_note(rows: Sequence[PlanRow], best: PlanRow, config: PlanConfig) -> str:
    """Why `best` runs its checkpointing policy ("" for none), beside the same plan under the other policies:
    "; checkpointing selective (off needs 1 GiB, full not needed)". A lighter policy without a row was not allowed
    (`PlanConfig.checkpointing`) or, selective, not measured by the profile; a heavier one was not needed (tried
    only where the one below it is over the cap)."""
    if best.checkpointing == "off":
        return ""
    key = (best.schedule, best.microbatches, best.zero, best.window, best.mesh, best.offload)
    same = {r.checkpointing: r for r in rows
            if (r.schedule, r.microbatches, r.zero, r.window, r.mesh, r.offload) == key}
    allowed = {checkpointing_policy(p) for p in config.checkpointing}
    notes = []
    for policy in CHECKPOINTING:
        row = same.get(policy)
        if policy == best.checkpointing:
            continue
        if row is None:
            heavier = CHECKPOINTING.index(policy) > CHECKPOINTING.index(best.checkpointing)
            notes.append(f"{policy} not needed" if heavier else f"{policy} not allowed" if policy not in allowed
                         else f"{policy} not measured by the profile")
        elif row.over_cap:
            notes.append(f"{policy} needs {format_bytes(row.peak_bytes)}")
        elif row.feasible:
            notes.append(f"{policy} fits at {format_bytes(row.peak_bytes)}, {row.step_s / best.step_s - 1:+.0%} step")
        else:
            notes.append(f"{policy}: {row.rejected}")
    return f"; checkpointing {best.checkpointing} ({', '.join(notes)})"


def offload_note(rows: Sequence[PlanRow], best: PlanRow, config: PlanConfig) -> str:
    """What `best`'s offload costs, or, when memory decided and no host link is known, that offload was not
    planned ("" otherwise)."""
    if best.offload is not False:
        return f"; offload {offload_label(best.offload)} (copies add {best.offload_s * 1e3:.3g} ms beyond the compute)"
    if config.host_link is None and any(r.over_cap and r.step_s <= best.step_s for r in rows):
        return "; activation offload not planned: no host-copy bandwidth known"
    return ""
