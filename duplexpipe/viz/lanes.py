"""A measured timeline with its extra lanes: the schedule's Gantt chart above, a strip per rank and lane
(e.g. the data-parallel bucket reductions on lane "dp") below, on one time axis."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from duplexpipe.schedules.timeline import Timeline
from duplexpipe.viz import _style as st
from duplexpipe.viz.gantt import DPI, FIG_WIDTH, LEFT_IN, RIGHT_IN, ROW_IN, Frame, draw_gantt, headline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SPAN_GID = "dpspan"
"""gid prefix of the span boxes (one per span)."""
IN_FLIGHT_COLOR = "#8FB9D9"
"""A reduction in flight (started, not yet complete)."""
WAIT_COLOR = "#C0392B"
"""The main thread blocked waiting for reductions (communication not hidden)."""


def plot_timeline_lanes(timeline: Timeline, path: str | os.PathLike[str] | None = None, *,
                        title: str | None = None) -> Figure:
    """Draw `timeline`'s compute events (as plot_timeline does) and, below, its spans lane by lane.

    Spans named "wait" are drawn in red (time the rank blocked on them); the others (e.g. "bucket 3")
    in blue from their start to their completion. The time axis covers events and spans. Saves to
    `path` (.png, .svg or .pdf) when given; returns the figure.
    """
    st.check_timeline(timeline)
    if not timeline.spans:
        raise ValueError(f"timeline {timeline.schedule_name!r} has no spans on extra lanes to draw "
                         "(record a training step of a Pipeline with data parallelism)")
    if path is not None:
        st.check_figure_path(os.fspath(path))
    ranks, lanes = timeline.num_ranks, timeline.lanes()
    gantt_h, lane_h = max(1.0, ROW_IN * ranks), max(0.8, 0.26 * ranks * len(lanes))
    top, gap, bottom = 0.95, 0.45, 0.5
    fig = st.new_figure(FIG_WIDTH, top + gantt_h + gap + lane_h + bottom, DPI)
    height = fig.get_size_inches()[1]
    width = FIG_WIDTH - LEFT_IN - RIGHT_IN
    scale, unit = st.time_scale(timeline)
    end = max(timeline.start + timeline.makespan, max(s.end for s in timeline.spans))
    frame = Frame(timeline.start, scale, (end - timeline.start) * scale)
    ax = st.new_axes(fig, (LEFT_IN, height - top - gantt_h, width, gantt_h))
    draw_gantt(ax, timeline, frame, st.directions_of(timeline.events, ranks))
    ax.set_xlim(0, frame.xmax)
    ax.tick_params(labelbottom=False)
    low = st.new_axes(fig, (LEFT_IN, bottom, width, lane_h))
    low.sharex(ax)
    draw_lanes(low, timeline, frame)
    low.set_xlabel(f"time ({unit})", fontsize=9)
    fig.text(0.5, 1 - 0.1 / height, title or headline(timeline), ha="center", va="top", fontsize=12,
             fontweight="bold")
    fig.text(0.5, 1 - 0.36 / height, f"{timeline.source} \u00b7 lanes below: blue = in flight, red = the rank "
             "waited for it", ha="center", va="top", fontsize=8.5, color="#555555")
    if path is not None:
        fig.savefig(os.fspath(path), dpi=DPI)
    return fig


LANE_MEANINGS = {
    "dp": "dp = data-parallel bucket reductions from start to completion, and the final wait",
    "ep": "ep = expert-parallel all-to-alls (MoE dispatch and combine) from issue to completion",
    "fsdp": "fsdp = ZeRO-3's all-gathers (UNSHARD) and reduce-scatters (REDUCE_GRAD) from start to completion",
}


def lanes_caption(lanes: list[str]) -> str:
    """What the lanes below the chart show, one clause per lane present."""
    return "; ".join(LANE_MEANINGS.get(lane, f"{lane} = work beside the schedule") for lane in lanes)


def draw_lanes(ax: Axes, timeline: Timeline, frame: Frame) -> int:
    """One row per (rank, lane) with a box per span; returns how many boxes were drawn."""
    from matplotlib.patches import Rectangle

    lanes = timeline.lanes()
    rows = [(r, lane) for r in range(timeline.num_ranks) for lane in lanes]
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows], fontsize=7.5)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#D0D0D0", linewidth=0.5, linestyle=":", zorder=0)
    drawn = 0
    for s in sorted(timeline.spans, key=lambda s: (s.name == "wait", s.start)):
        row = rows.index((s.rank, s.lane))
        waiting = s.name == "wait"
        h = 0.7 if waiting else 0.45
        box = Rectangle((frame.x(s.start), row - h / 2), max(frame.x(s.end) - frame.x(s.start), 0.0), h,
                        facecolor=WAIT_COLOR if waiting else IN_FLIGHT_COLOR, edgecolor="white",
                        linewidth=0.4, alpha=0.9 if waiting else 0.75, zorder=3 if waiting else 2)
        box.set_gid(f"{SPAN_GID}-{drawn}")
        ax.add_patch(box)
        drawn += 1
    ax.set_title(lanes_caption(lanes), fontsize=8.5, loc="left", color="#333333")
    return drawn
