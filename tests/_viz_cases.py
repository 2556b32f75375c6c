"""Timelines the viz tests draw: every registered schedule simulated, and small hand-built ones."""

from __future__ import annotations

from dataclasses import replace

from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Schedule, parse_action
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.timeline import Event, Timeline

P, M = 4, 8


def schedule_names(num_ranks: int = P, num_microbatches: int = M) -> list[str]:
    """Every registered schedule that accepts (num_ranks, num_microbatches)."""
    return [n for n in registry.names() if registry.check(n, num_ranks, num_microbatches) is None]


def simulated(name: str, num_ranks: int = P, num_microbatches: int = M) -> tuple[Schedule, Timeline]:
    """The compute-only schedule and its simulated timeline under the default costs."""
    schedule = registry.build(name, num_ranks, num_microbatches)
    return schedule, simulate(schedule, CostModel())


def hand_timeline(rows: list[list[tuple[str, float, float]]], name: str = "hand",
                  num_microbatches: int = 2) -> Timeline:
    """A timeline from per-rank (token, start, end) triples."""
    events = tuple(Event(r, parse_action(tok), s, e) for r, row in enumerate(rows) for tok, s, e in row)
    return Timeline(name, len(rows), num_microbatches, events)


def as_measured(timeline: Timeline, seconds_per_unit: float, origin: float) -> Timeline:
    """The same timeline as if measured: seconds, starting at `origin` (a perf_counter reading)."""
    events = tuple(replace(e, start=origin + e.start * seconds_per_unit, end=origin + e.end * seconds_per_unit)
                   for e in timeline.events)
    return replace(timeline, events=events, source="measured", unit="s")
