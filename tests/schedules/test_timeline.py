"""Tests of Timeline's per-rank queries: one index built once, equal to filtering the events."""

from __future__ import annotations

from _viz_cases import hand_timeline, simulated


def test_rank_queries_match_a_filter_over_all_events() -> None:
    _, timeline = simulated("dualpipe")
    for rank in range(timeline.num_ranks):
        mine = sorted((e for e in timeline.events if e.rank == rank), key=lambda e: (e.start, e.end))
        assert timeline.rank_events(rank) == mine
    assert timeline.rank_events(99) == []
    assert sum(timeline.busy(r) for r in range(timeline.num_ranks)) == sum(e.duration for e in timeline.events)


def test_rank_events_returns_a_copy_and_derived_values_are_stable() -> None:
    timeline = hand_timeline([[("0F0", 1, 2), ("0B0", 4, 6)], [("1F0", 2, 3), ("1B0", 3, 4)]])
    events = timeline.rank_events(0)
    events.clear()
    assert len(timeline.rank_events(0)) == 2, "callers cannot change the index"
    assert (timeline.start, timeline.makespan) == (1, 5) and timeline.makespan == 5
    assert timeline.idle(0) == 2 and timeline.idle(1) == 3 and timeline.bubble_ratio == 0.5
