"""Measured timelines: time every compute action (perf_counter, CUDA events on GPU), merge ranks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import Action
from duplexpipe.schedules.timeline import Event, Timeline

_NOTHING = contextlib.nullcontext()
MEASURED = "measured"
UNIT = "s"


class Tracer:
    """Records one step's compute events on one rank, in seconds since the step's start: time zero is its
    construction (right after the ranks synchronized); each step has its own.

    On CPU the clock is time.perf_counter. On CUDA each action is bracketed by CUDA events on
    the compute stream and resolved at the end of the step (waiting on the last event only).
    """

    __slots__ = ("rank", "cuda", "device", "enabled", "_origin", "_origin_event", "_spans")

    def __init__(self, rank: int, device: torch.device, enabled: bool) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.device = device
        self.enabled = enabled
        self._spans: list[tuple[Action, Any, Any]] = []
        self._origin = time.perf_counter()
        self._origin_event: Any = None
        if enabled and self.cuda:
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record(torch.cuda.current_stream(device))

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def span(self, action: Action) -> contextlib.AbstractContextManager[None]:
        """Time the compute of `action` (a shared no-op context when disabled)."""
        return self._timed(action) if self.enabled else _NOTHING

    def begin(self) -> Any:
        """The start mark of a compute action (None when disabled); pass it to `end` once it ran. Cheaper
        than `span` on the runtime's hot path (no generator)."""
        return self._mark() if self.enabled else None

    def end(self, action: Action, begin: Any) -> None:
        """Record `action` as having run from `begin` (from `begin()`) until now; nothing when disabled."""
        if begin is not None:
            self._spans.append((action, begin, self._mark()))

    @contextlib.contextmanager
    def _timed(self, action: Action) -> Iterator[None]:
        begin = self._mark()
        yield
        self._spans.append((action, begin, self._mark()))

    @property
    def origin(self) -> float:
        """time.perf_counter() at the step's start (time zero of its timeline)."""
        return self._origin

    @property
    def recorded(self) -> int:
        """How many compute actions this step has recorded so far (0 when disabled)."""
        return len(self._spans)

    def _seconds(self, mark: Any) -> float:
        if not self.cuda:
            return float(mark - self._origin)
        return float(self._origin_event.elapsed_time(mark)) / 1e3

    def timeline(self, schedule_name: str, num_ranks: int, num_microbatches: int) -> Timeline | None:
        """This rank's events of the step as a measured Timeline (None when disabled)."""
        if not self.enabled:
            return None
        if self.cuda and self._spans:
            self._spans[-1][2].synchronize()
        events = tuple(Event(self.rank, a, self._seconds(b), self._seconds(e)) for a, b, e in self._spans)
        return Timeline(schedule_name, num_ranks, num_microbatches, events, source=MEASURED, unit=UNIT)


def merge_timelines(parts: list[Timeline]) -> Timeline:
    """One Timeline holding every part's events; the parts must describe the same run."""
    if not parts:
        raise ValueError("merge_timelines needs at least one timeline")
    first = parts[0]
    for other in parts[1:]:
        same = (other.schedule_name, other.num_ranks, other.num_microbatches, other.source, other.unit)
        if same != (first.schedule_name, first.num_ranks, first.num_microbatches, first.source, first.unit):
            raise ValueError(f"cannot merge timelines of different runs: {same} vs "
                             f"{(first.schedule_name, first.num_ranks, first.num_microbatches)}")
    events = sorted((e for t in parts for e in t.events), key=lambda e: (e.rank, e.start, e.end))
    spans = sorted((s for t in parts for s in t.spans), key=lambda s: (s.rank, s.lane, s.start, s.end))
    return Timeline(first.schedule_name, first.num_ranks, first.num_microbatches, tuple(events),
                    source=first.source, unit=first.unit, spans=tuple(spans))


def gather_timeline(timeline: Timeline, group: Any = None) -> Timeline:
    """Merge all ranks' measured events of one step (collective: call it on every rank).

    Times are seconds since each rank's step start; the ranks leave the step-start
    agreement together, so the merged times line up across ranks.
    """
    size = dist.get_world_size(group)
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, timeline.to_dict(), group=group)
    try:
        parts = [Timeline.from_dict(d) for d in gathered]
    except ScheduleError as exc:
        raise ValueError(f"gather_timeline: a rank sent a malformed timeline: {exc}") from None
    return merge_timelines(parts)
