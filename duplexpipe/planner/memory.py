"""Memory in bytes per rank: parameters, gradients, optimizer states, live activations and in-flight messages."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from duplexpipe.errors import ProfileError
from duplexpipe.planner.dp_comm import zero_stage
from duplexpipe.planner.host_offload import moves
from duplexpipe.planner.profile import PartProfile, Profile, load_profile
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.shard import gradient_peak
from duplexpipe.schedules.timeline import Timeline

GLOO_RECEIVES_AHEAD = 2
"""How many receives per peer the runtime posts ahead over gloo (`RuntimeConfig.recv_lookahead`'s default; a test
keeps them equal)."""


@dataclass(frozen=True)
class MemoryConfig:
    """What sits beside the activations on every rank."""

    optimizer_factor: float = 2.0
    """Optimizer-state bytes per parameter byte (Adam/AdamW keep two states: 2 at fp32; SGD momentum 1)."""
    gradient_factor: float = 1.0
    """Gradient bytes per parameter byte."""
    zero_stage: int = 0
    """ZeRO stage (see `dp_comm.ZERO_STAGES`): what is sharded over the data-parallel replicas."""
    dp: int = 1
    """Data-parallel replicas D."""
    sends_held: bool = False
    """A sent message stays on its sender until a reply proves it received (gloo, which completes a send only when
    waited for: the runtime waits once the rank took a message its peer sent after taking this one, `RankPlan.
    sends_done`), not only until its consumer starts (NCCL, whose sends complete on their own)."""
    receives_ahead: int = 0
    """Receives from a peer posted this many ahead of their turn (gloo: `RuntimeConfig.recv_lookahead`,
    `GLOO_RECEIVES_AHEAD` by default): a receive's buffer is held from when the one this many before it from the
    same peer was taken (the step's start for the first ones), not only from when its message was made."""
    offload: bool | float = False
    """Activation offload (`PipelineConfig.activation_offload`): a forward's saved bytes leave the rank while they
    are on host (`host_offload.moves`, the runtime's plan over the timeline); False: none."""

    def __post_init__(self) -> None:
        for name in ("optimizer_factor", "gradient_factor"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        zero_stage(self.zero_stage)
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp must be an integer >= 1, got {self.dp!r}")
        if not isinstance(self.receives_ahead, int) or self.receives_ahead < 0:
            raise ValueError(f"receives_ahead must be an integer >= 0, got {self.receives_ahead!r}")


@dataclass(frozen=True)
class StageBytes:
    """Per stage of one schedule: what one microbatch keeps and sends, and its part's parameters."""

    activation: tuple[int, ...]
    """Bytes one microbatch's forward saves for backward."""
    params: tuple[int, ...]
    """Parameter bytes of the stage's model part (each stage holds its own copy)."""
    output: tuple[int, ...]
    """Bytes of its forward message to the next stage."""
    output_grad: tuple[int, ...]
    """Bytes of the gradient of its output (the message it receives back)."""
    recompute: tuple[int, ...] = ()
    """Per stage, what a checkpointed stage's recompute holds beyond its saved inputs (its whole activation of one
    microbatch less the inputs; 0 for a stage not checkpointed), from the start of its B or I to the end of its B or
    W (under a split backward what W needs stays from I to W); () for none."""

    @staticmethod
    def of(schedule: Schedule, groups: Sequence[PartProfile], recompute: Sequence[int] = ()) -> StageBytes:
        """Each stage takes its weight group's entry of `groups` (one PartProfile per model part) and of
        `recompute` (per model part, see the field; () for none)."""
        if len(groups) != schedule.num_groups:
            raise ValueError(f"{schedule.name!r} has {schedule.num_groups} model parts, got {len(groups)} "
                             "part profiles")
        parts = [groups[info.group] for info in schedule.stages]
        extra = tuple(recompute[info.group] for info in schedule.stages) if recompute else ()
        return StageBytes(tuple(p.activation_bytes for p in parts), tuple(p.param_bytes for p in parts),
                          tuple(p.output_bytes for p in parts), tuple(p.output_grad_bytes for p in parts), extra)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory, bytes."""

    rank: int
    """The pipeline rank."""
    params: float
    """Parameters of the stages it holds (DualPipe: both copies); under ZeRO-3 their 1/D shards at rest plus the
    most unsharded stages its residency window holds at once."""
    gradients: float
    """Their gradients (1/D of them under ZeRO-2)."""
    optimizer: float
    """Optimizer states (1/D under ZeRO-1 and -2)."""
    activations: float
    """Peak of the live activations alone (a checkpointed stage's recompute included, `StageBytes.recompute`; what
    is offloaded to host left out while it is there, `MemoryConfig.offload`)."""
    messages: float
    """Peak of the in-flight messages alone."""
    peak: float
    """params + gradients + optimizer + the peak of (live activations + in-flight messages)."""

    def to_dict(self) -> dict[str, float]:
        """A JSON-ready form."""
        return {"rank": self.rank, "params": self.params, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations, "messages": self.messages,
                "peak": self.peak}


def rank_memory(schedule: Schedule, timeline: Timeline, sizes: StageBytes,
                config: MemoryConfig | None = None) -> list[RankMemory]:
    """Per rank: the byte model of DESIGN's memory section, over the simulated (or measured) `timeline`.

    An activation lives from the start of its F to the end of its B or W (as
    `Timeline.activation_curve`); a message between ranks occupies its bytes on both ranks
    from the end of its producer to the start of its consumer. Releases at a time come
    before allocations at the same time. Parameters, gradients and optimizer state as `state_bytes`, the unsharded
    parameters under ZeRO-3 those of the stages the schedule holds unsharded at once (`resident_peak`), its
    gradients those its REDUCE_GRAD actions leave (`gradient_bytes`).
    """
    config = config or MemoryConfig()
    curves = _curves(schedule, timeline, sizes, config.sends_held, config.receives_ahead)
    if config.offload is not False:
        for move in moves(timeline, config.offload):
            away = sizes.activation[move.stage]
            curves[move.rank][0].extend(((move.start, -away), (move.back, away)))
    out = []
    for rank in range(schedule.num_ranks):
        whole = float(sum(sizes.params[s] for s in schedule.stages_of_rank(rank)))
        params, grads, optim = state_bytes(whole, resident_peak(schedule, rank, sizes.params), config,
                                           gradient_bytes(schedule, rank, sizes.params, config))
        act, msg = curves[rank]
        both = _peak(act + msg)
        out.append(RankMemory(rank, params, grads, optim, _peak(act), _peak(msg), params + grads + optim + both))
    return out


def state_bytes(params: float, unsharded: float, config: MemoryConfig,
                grads: float | None = None) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes a rank holds at its peak, its stages' parameters taking `params`
    bytes whole, `unsharded` of them unsharded at once under ZeRO-3, as the runtime holds them on FSDP2: ZeRO-2 keeps
    the 1/D shards beside the whole parameters, ZeRO-3 the shards and the unsharded stages; gradients stay whole
    (unreduced) until the step's one reduce-scatter per stage at every ZeRO stage, unless `grads` says otherwise
    (ZeRO-3's gradients at their peak, `gradient_bytes`: a window smaller than the rank's stages reduces after each
    episode); optimizer state 1/D from ZeRO-1."""
    zero, d = zero_stage(config.zero_stage), config.dp
    held = params / d + unsharded if zero.shard_params else params + (params / d if zero.shard_gradients else 0.0)
    grad = params * config.gradient_factor if grads is None else grads
    return held, grad, params * config.optimizer_factor / (d if zero.shard_optimizer else 1)


def gradient_bytes(schedule: Schedule, rank: int, params: Sequence[float], config: MemoryConfig) -> float | None:
    """The most gradient bytes `rank` holds at once under ZeRO-3's REDUCE_GRAD actions in `schedule` (each stage's
    whole while it accumulates, its 1/D shard after its first reduction: `shard.gradient_peak`); None for a
    schedule without them or a ZeRO stage below 3 (whole until the step's reduction)."""
    if not zero_stage(config.zero_stage).shard_params or not any(
            a.op is Op.REDUCE_GRAD for row in schedule.actions for a in row):
        return None
    whole = [p * config.gradient_factor for p in params]
    return gradient_peak(schedule, rank, whole, [g / config.dp for g in whole])


def resident_peak(schedule: Schedule, rank: int, params: Sequence[float]) -> float:
    """The most parameter bytes `rank` holds unsharded at once: over its list, each UNSHARD adds its stage's
    `params` until the stage's RESHARD (counted from the UNSHARD's issue, when the all-gather's buffer is taken);
    a schedule without these actions holds all of the rank's stages."""
    if not schedule.has_fsdp:
        return float(sum(params[s] for s in schedule.stages_of_rank(rank)))
    live = peak = 0.0
    for action in schedule.actions[rank]:
        if action.op is Op.UNSHARD:
            live += params[action.stage]
            peak = max(peak, live)
        elif action.op is Op.RESHARD:
            live -= params[action.stage]
    return peak


def _curves(schedule: Schedule, timeline: Timeline, sizes: StageBytes, sends_held: bool = False,
            receives_ahead: int = 0) -> list[tuple[list[tuple[float, float]], list[tuple[float, float]]]]:
    """Per rank: (activation deltas, message deltas) as (time, +-bytes)."""
    curves: list[tuple[list[tuple[float, float]], list[tuple[float, float]]]] = [
        ([], []) for _ in range(schedule.num_ranks)]
    fwd: dict[tuple[int, int], tuple[float, float]] = {}
    bwd: dict[tuple[int, int], tuple[float, float]] = {}
    for event in timeline.events:
        for part in event.action.compute_parts():
            key = (part.stage, part.microbatch)
            act = curves[event.rank][0]
            again = sizes.recompute[part.stage] if sizes.recompute else 0
            if part.op is Op.F:
                fwd[key] = (event.start, event.end)
                act.append((event.start, sizes.activation[part.stage]))
            elif part.op in (Op.B, Op.W):
                act.append((event.end, -sizes.activation[part.stage] - again))
            if part.op in (Op.B, Op.I) and again:  # the recompute, held from here to the end of its B or W
                act.append((event.start, again))
            if part.op in (Op.B, Op.I):
                bwd[key] = (event.start, event.end)
    rank_of = [info.rank for info in schedule.stages]
    messages: list[_Message] = []
    for (stage, mb), producer in fwd.items():
        nxt = schedule.next_stage(stage)
        if nxt is not None and rank_of[nxt] != rank_of[stage] and (nxt, mb) in fwd:
            messages.append(_Message(rank_of[stage], rank_of[nxt], producer, fwd[(nxt, mb)], sizes.output[stage]))
    for (stage, mb), producer in bwd.items():
        prv = schedule.prev_stage(stage)
        if prv is not None and rank_of[prv] != rank_of[stage] and (prv, mb) in bwd:
            messages.append(_Message(rank_of[stage], rank_of[prv], producer, bwd[(prv, mb)],
                                     sizes.output_grad[prv]))
    end = timeline.start + timeline.makespan
    by_link: dict[tuple[int, int], tuple[list[float], list[_Message]]] = {}
    for message in sorted(messages, key=lambda m: m.producer[0]):
        starts, mine = by_link.setdefault((message.sender, message.receiver), ([], []))
        starts.append(message.producer[0])
        mine.append(message)
    posted = _posted(by_link, receives_ahead, timeline.start) if receives_ahead else {}
    for message in messages:
        start, taken = message.producer[1], message.consumer[0]
        released = _released(message, by_link, end) if sends_held else taken
        curves[message.sender][1].extend(((start, message.nbytes), (max(start, released), -message.nbytes)))
        buffered = min(start, posted.get(id(message), start))
        curves[message.receiver][1].extend(((buffered, message.nbytes), (max(buffered, taken), -message.nbytes)))
    return curves


@dataclass(frozen=True)
class _Message:
    """One stage-to-stage message: its ranks, the (start, end) of the compute that makes it and of the one that
    takes it, its bytes."""

    sender: int
    receiver: int
    producer: tuple[float, float]
    consumer: tuple[float, float]
    nbytes: int


def _posted(by_link: dict[tuple[int, int], tuple[list[float], list[_Message]]], ahead: int,
            start: float) -> dict[int, float]:
    """When each message's receive buffer is posted, by id: on each directed link in the order the receiver takes
    them, just before the one `ahead` before is taken (its RECV is listed before the compute that takes it; the
    step's `start` for the first `ahead`)."""
    out: dict[int, float] = {}
    for _, mine in by_link.values():
        order = sorted(mine, key=lambda m: m.consumer[0])
        for k, message in enumerate(order):
            out[id(message)] = math.nextafter(order[k - ahead].consumer[0], -math.inf) if k >= ahead else start
    return out


def _released(message: _Message, by_link: dict[tuple[int, int], tuple[list[float], list[_Message]]],
              end: float) -> float:
    """When the sender of `message` learns it was received: the end of its compute that takes the first reply its
    peer made after taking `message` (`by_link`: each directed link's messages by their producer's start; no reply:
    the step's end)."""
    starts, replies = by_link.get((message.receiver, message.sender), ([], []))
    at = bisect.bisect_left(starts, message.consumer[1])
    return end if at == len(replies) else replies[at].consumer[1]


def _peak(deltas: list[tuple[float, float]]) -> float:
    """The largest running sum of (time, delta), releases first at equal times."""
    live = peak = 0.0
    for _, delta in sorted(deltas, key=lambda d: (d[0], d[1])):
        live += delta
        peak = max(peak, live)
    return peak


def profile_memory(schedule: Schedule, timeline: Timeline, path: str) -> list[dict[str, Any]]:
    """Per rank, the byte model (at the profile's microbatch size) over `timeline`; ProfileError if unusable."""
    profile: Profile = load_profile(path)
    groups = profile.grouped(schedule.num_groups)
    return [m.to_dict() for m in rank_memory(schedule, timeline, StageBytes.of(schedule, groups), MemoryConfig())]


def add_peak_bytes(rows: list[dict[str, Any]], timelines: Sequence[Timeline], path: str) -> None:
    """Add "peak_bytes" (the largest per-rank peak, or "peak_bytes_error") to compare's rows, in place.

    The byte model needs only each schedule's stage table beside its timeline, so nothing is
    searched again (auto is built with its default placement, one stage per rank).
    """
    from duplexpipe.schedules import registry
    from duplexpipe.schedules.generators._common import linear_stages

    done = iter(timelines)
    for row in rows:
        if "skipped" in row:
            continue
        timeline = next(done)
        ranks, mbs = timeline.num_ranks, timeline.num_microbatches
        table = linear_stages(ranks) if row["schedule"] == "auto" else \
            registry.build(row["schedule"], ranks, mbs).stages
        schedule = Schedule(row["schedule"], ranks, mbs, table, tuple(() for _ in range(ranks)))
        try:
            row["peak_bytes"] = max(r["peak"] for r in profile_memory(schedule, timeline, path))
        except ProfileError as exc:
            if "parts" not in str(exc) or "at least" not in str(exc):
                raise
            row["peak_bytes_error"] = str(exc)
