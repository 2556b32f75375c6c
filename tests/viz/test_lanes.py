"""Tests of duplexpipe.viz.lanes and the Timeline's extra lanes (spans): drawing, JSON form, merging."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from _viz_cases import hand_timeline

from duplexpipe.runtime.timing import merge_timelines
from duplexpipe.schedules.timeline import Span, Timeline
from duplexpipe.viz import _style as st
from duplexpipe.viz.lanes import SPAN_GID, plot_timeline_lanes

imread = pytest.importorskip("matplotlib.image").imread


def _timeline() -> Timeline:
    base = hand_timeline([[("0F0", 0.0, 1.0), ("0B0", 2.0, 4.0)], [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0)]])
    spans = (Span(1, "dp", "bucket 0", 3.0, 5.5), Span(0, "dp", "bucket 1", 4.0, 4.5),
             Span(0, "dp", "wait", 4.2, 4.5), Span(1, "dp", "wait", 4.0, 5.5))
    return replace(base, spans=spans)


def test_spans_round_trip_through_json_and_leave_the_schedule_figures_alone() -> None:
    timeline = _timeline()
    again = Timeline.from_dict(timeline.to_dict())
    assert again == timeline and again.lanes() == ["dp"]
    bare = replace(timeline, spans=())
    assert "spans" not in bare.to_dict()  # the JSON of a timeline without lanes is unchanged
    assert (timeline.makespan, timeline.bubble_ratio, timeline.busy(0)) == (bare.makespan, bare.bubble_ratio,
                                                                            bare.busy(0))


def test_merging_ranks_keeps_their_spans() -> None:
    timeline = _timeline()
    parts = [replace(timeline, events=tuple(e for e in timeline.events if e.rank == r),
                     spans=tuple(s for s in timeline.spans if s.rank == r)) for r in (0, 1)]
    merged = merge_timelines(parts)
    assert sorted(merged.spans, key=str) == sorted(timeline.spans, key=str)


def test_lanes_figure_draws_every_span_below_the_gantt(tmp_path: Path) -> None:
    timeline = _timeline()
    png = tmp_path / "lanes.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_timeline_lanes(timeline, png)
    spans = [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(SPAN_GID)]
    assert len(spans) == len(timeline.spans)
    boxes = [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(st.BOX_GID)]
    assert len(boxes) == len(timeline.events)
    assert fig.axes[0].get_xlim()[1] == pytest.approx(5.5)  # the axis covers spans past the last event
    pixels = imread(png)[..., :3]
    assert 0.03 < (pixels.min(axis=2) < 0.9).mean() < 0.9
    with pytest.raises(ValueError, match="has no spans on extra lanes"):
        plot_timeline_lanes(replace(timeline, spans=()))
    with pytest.raises(ValueError, match="unsupported figure format"):
        plot_timeline_lanes(timeline, tmp_path / "x.gif")
