"""Activation offload in the planner: which forwards' saved tensors a rank holds in host memory, when, and what the
copies cost beyond the compute they overlap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from duplexpipe.planner.dp_comm import Link
from duplexpipe.schedules.offload import offload_plan
from duplexpipe.schedules.timeline import Event, Timeline

OFFLOAD_FRACTIONS: tuple[bool | float, ...] = (0.5, True)
"""`PlanConfig.offload`'s default: half of the live forwards, then all but the one whose backward is next (the
runtime's `activation_offload` values)."""


@dataclass(frozen=True)
class Move:
    """One forward's saved tensors on host: from the end of the forward that chose it (the copy out overlaps the
    rank's next compute) to the start of the compute before its B or I (the copy back overlaps that compute)."""

    rank: int
    stage: int
    microbatch: int
    start: float
    """When its bytes leave the device."""
    back: float
    """When they are on the device again."""
    out_overlap: float
    """Seconds of the compute its copy out overlaps."""
    back_overlap: float
    """Seconds of the compute its copy back overlaps."""


def check_fraction(value: object) -> bool | float:
    """An offload value the planner plans (True, or a fraction 0 < f <= 1); ValueError naming it otherwise."""
    if value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1):
        return value  # type: ignore[return-value]
    raise ValueError(f"offload values must be True (all but the next backward's) or fractions 0 < f <= 1, "
                     f"got {value!r}")


def moves(timeline: Timeline, policy: bool | float) -> list[Move]:
    """What the runtime's offload plan (`runtime.offload.offload_plan`) moves, over the timeline's compute events per
    rank: after each event that ends forwards, the live forwards (F done, B or I not started) ranked by how far
    their B or I is; the furthest of them (True: all but the nearest; f: floor(f x live)) are on host, each newly
    chosen one offloaded then, only where at least one compute runs while it is away."""
    out: list[Move] = []
    for rank in range(timeline.num_ranks):
        out.extend(_rank_moves(rank, sorted(timeline.rank_events(rank), key=lambda e: e.start), policy))
    return out


def _rank_moves(rank: int, events: Sequence[Event], policy: bool | float) -> list[Move]:
    """The moves of `offload_plan` over one rank's compute events (its list without the transfers: each prefetch
    then comes right after the event two before the backward, its copy overlapping the one just before)."""
    plan = offload_plan([e.action for e in events], policy)
    back = {key: pos + 1 for pos, keys in plan.prefetch_after.items() for key in keys}
    return [Move(rank, stage, mb, events[pos].end, events[back[(stage, mb)]].start, events[pos + 1].duration,
                 events[back[(stage, mb)]].duration)
            for pos, keys in plan.offload_after.items() for stage, mb in keys]


def copy_time(done: Sequence[Move], activation: Sequence[float], link: Link, ranks: int) -> float:
    """What the copies add to the step: per rank, each move's copy out and copy back (its stage's `activation`
    bytes on `link`) beyond the compute each overlaps, summed; the most of any rank."""
    per_rank = [0.0] * ranks
    for move in done:
        copy = link.time(activation[move.stage])
        per_rank[move.rank] += max(0.0, copy - move.out_overlap) + max(0.0, copy - move.back_overlap)
    return max(per_rank, default=0.0)


def offload_label(value: bool | float) -> str:
    """How a plan says its offload: "off", "50%", "all-1" (all but the next backward's)."""
    if value is False:
        return "off"
    return "all-1" if value is True else f"{float(value):.0%}"
