"""Timeline: timed compute actions per rank, with extra lanes and memory steps, from the simulator or a run."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import Action, Op, format_action, parse_action

MAX_TIMELINE_FILE_BYTES = 256 * 2**20
"""Largest timeline file the command line reads (256 MiB), refused before it is parsed (a timeline of P x M =
500,000 is about 120 MB)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One compute action that ran on `rank` from `start` to `end` (seconds or cost units)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        """end - start."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Span:
    """Work outside the schedule's compute that ran on `rank` beside it, on its own named lane (e.g. a
    data-parallel bucket reduction in flight on lane "dp"); not counted in busy, idle or the makespan."""

    rank: int
    lane: str
    name: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class MemoryStep:
    """From `time` on (until the rank's next step), `rank` holds `params` bytes of parameters (shards at rest and
    unsharded stages) and `grads` bytes of gradients (unsharded until reduced, then shards)."""

    rank: int
    time: float
    params: float
    grads: float


@dataclass(frozen=True)
class Timeline:
    """What ran where and when; `source` is "simulated" or "measured"."""

    schedule_name: str
    num_ranks: int
    num_microbatches: int
    events: tuple[Event, ...]
    source: str = "simulated"
    unit: str = "cost units"
    spans: tuple[Span, ...] = ()
    """Extra lanes (see Span); the schedule's events and every figure derived from them ignore these."""
    memory: tuple[MemoryStep, ...] = ()
    """Parameter and gradient bytes per rank over time, in time order per rank (see MemoryStep; empty unless the
    simulator was given parameter bytes)."""

    def rank_events(self, rank: int) -> list[Event]:
        """The events of one rank ordered by start."""
        return list(self._by_rank.get(rank, ()))

    @cached_property
    def _by_rank(self) -> dict[int, tuple[Event, ...]]:
        """rank -> its events ordered by start, built once (per-rank queries stay linear in all)."""
        grouped: dict[int, list[Event]] = {}
        for e in self.events:
            grouped.setdefault(e.rank, []).append(e)
        return {r: tuple(sorted(row, key=lambda e: (e.start, e.end))) for r, row in grouped.items()}

    @cached_property
    def start(self) -> float:
        """The earliest start over all events (0 for simulated timelines)."""
        return min((e.start for e in self.events), default=0.0)

    @cached_property
    def makespan(self) -> float:
        """Time from the first start to the last end."""
        return max((e.end for e in self.events), default=0.0) - self.start

    def busy(self, rank: int) -> float:
        """Total compute time of `rank` (overlapping events are not double counted)."""
        total, cursor = 0.0, float("-inf")
        for e in self.rank_events(rank):
            lo = max(e.start, cursor)
            if e.end > lo:
                total += e.end - lo
            cursor = max(cursor, e.end)
        return total

    def idle(self, rank: int) -> float:
        """makespan - busy(rank)."""
        return self.makespan - self.busy(rank)

    @property
    def bubble_ratio(self) -> float:
        """Total idle time over (ranks x makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return sum(self.idle(r) for r in range(self.num_ranks)) / (self.num_ranks * span)

    def activation_curve(self, rank: int) -> list[tuple[float, int]]:
        """(time, live activations) steps for `rank`.

        A (stage, microbatch) activation is live from the start of its F until the end
        of its B, or of its W when the backward is split. Releases at a time come
        before allocations at the same time.
        """
        deltas: list[tuple[float, int]] = []
        for e in self.rank_events(rank):
            for part in e.action.compute_parts():
                if part.op is Op.F:
                    deltas.append((e.start, +1))
                elif part.op in (Op.B, Op.W):
                    deltas.append((e.end, -1))
        deltas.sort()
        curve, live = [], 0
        for t, d in deltas:
            live += d
            curve.append((t, live))
        return curve

    def peak_activations(self, rank: int) -> int:
        """The most activations live at once on `rank`."""
        return max((live for _, live in self.activation_curve(rank)), default=0)

    def memory_curve(self, rank: int) -> list[MemoryStep]:
        """The memory steps of `rank` in time order."""
        return [m for m in self.memory if m.rank == rank]

    def peak_memory(self, rank: int) -> tuple[float, float]:
        """(most parameter bytes, most gradient bytes) `rank` holds at once (0, 0 without memory steps)."""
        curve = self.memory_curve(rank)
        return max((m.params for m in curve), default=0.0), max((m.grads for m in curve), default=0.0)

    def lanes(self) -> list[str]:
        """The names of the extra lanes, in order of first appearance."""
        return list(dict.fromkeys(s.lane for s in self.spans))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form ("spans" only when there are some)."""
        out: dict[str, Any] = {
            "schedule": self.schedule_name,
            "ranks": self.num_ranks,
            "microbatches": self.num_microbatches,
            "source": self.source,
            "unit": self.unit,
            "events": [[e.rank, format_action(e.action), e.start, e.end] for e in self.events],
        }
        if self.spans:
            out["spans"] = [[s.rank, s.lane, s.name, s.start, s.end] for s in self.spans]
        if self.memory:
            out["memory"] = [[m.rank, m.time, m.params, m.grads] for m in self.memory]
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Timeline:
        """Inverse of `to_dict`."""
        try:
            events = tuple(Event(int(r), parse_action(a), float(s), float(t))
                           for r, a, s, t in data["events"])
            spans = tuple(Span(int(r), str(lane), str(name), float(s), float(t))
                          for r, lane, name, s, t in data.get("spans", ()))
            memory = tuple(MemoryStep(int(r), float(t), float(p), float(g)) for r, t, p, g in data.get("memory", ()))
            return Timeline(data["schedule"], int(data["ranks"]), int(data["microbatches"]),
                            events, data.get("source", "simulated"), data.get("unit", "cost units"), spans, memory)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"malformed timeline: {exc}") from None
