"""Gantt chart of one timeline: a box per action on a real time axis, idle shares, activations, transfers."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.timeline import Event, Timeline
from duplexpipe.viz import _style as st

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
PathOrAxes = Union[str, "os.PathLike[str]", "Axes", Sequence["Axes"], None]

DPI = 150
"""Resolution of saved raster figures (dots per inch)."""
FIG_WIDTH = 12.0
"""Figure width in inches."""
ROW_IN = 0.34
"""Height of one rank's row in the Gantt panel, inches."""
ACT_ROW_IN = 0.24
"""Height of one rank's strip in the activations panel, inches."""
LEFT_IN, RIGHT_IN = 0.8, 0.75
"""Margins for rank labels (left) and idle shares (right), inches."""
BOX_H = 0.8
"""Box height as a fraction of a row."""


@dataclass(frozen=True)
class Frame:
    """Where a timeline's events land on the x axis: x = (t - origin) * scale."""

    origin: float
    """The time drawn at x = 0."""
    scale: float
    """Factor from the timeline's unit to the axis unit."""
    xmax: float
    """Right end of the x axis (axis units)."""

    def x(self, t: float) -> float:
        """Axis position of time `t`."""
        return (t - self.origin) * self.scale


def frame_of(timeline: Timeline, scale: float = 1.0, xmax: float | None = None) -> Frame:
    """The frame that puts the timeline's first start at 0."""
    return Frame(timeline.start, scale, timeline.makespan * scale if xmax is None else xmax)


def plot_timeline(timeline: Timeline, path_or_axes: PathOrAxes, *, activations: bool = False,
                  transfers: bool | Schedule | None = None, title: str | None = None) -> Figure | None:
    """Draw `timeline` as a Gantt chart: one row per rank, one box per compute action.

    `path_or_axes` is a file name (.png, .svg or .pdf: the figure is saved and returned), None
    (the figure is returned unsaved) or a matplotlib Axes to draw into (a pair of Axes when
    `activations` is set; returns None). `activations` adds a panel of live activations per rank.
    `transfers` draws P2P transfer arrows: True infers them from consecutive stages, a Schedule
    takes the chains from its stage table. Simulated and measured timelines are both accepted.
    """
    st.check_timeline(timeline)
    if _is_axes_like(path_or_axes):
        _plot_into_axes(timeline, path_or_axes, activations, transfers, title)
        return None
    path = None if path_or_axes is None else os.fspath(path_or_axes)  # type: ignore[arg-type]
    if path is not None:
        st.check_figure_path(path)
    fig = _timeline_figure(timeline, activations, transfers, title)
    if path is not None:
        fig.savefig(path, dpi=DPI)
    return fig


def _is_axes_like(obj: Any) -> bool:
    if obj is None or isinstance(obj, (str, bytes, os.PathLike)):
        return False
    if isinstance(obj, Sequence):
        return all(hasattr(a, "add_patch") for a in obj)
    return hasattr(obj, "add_patch")


def _plot_into_axes(timeline: Timeline, axes: Any, activations: bool,
                    transfers: bool | Schedule | None, title: str | None) -> None:
    group = list(axes) if isinstance(axes, Sequence) else [axes]
    if len(group) != (2 if activations else 1):
        raise ValueError(f"activations={activations} needs {2 if activations else 1} Axes, got {len(group)}")
    scale, unit = st.time_scale(timeline)
    frame = frame_of(timeline, scale)
    dirs = st.directions_of(timeline.events, timeline.num_ranks)
    draw_gantt(group[0], timeline, frame, dirs, transfers=transfers)
    group[0].set_title(title or headline(timeline), fontsize=10)
    handles, labels = st.legend_entries(*st.timeline_kinds([timeline]), dirs)
    group[0].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=7,
                    frameon=False, handler_map={st.Swatch: st._swatch_handler()})
    if activations:
        draw_activations(group[1], timeline, frame)
    group[-1].set_xlabel(f"time ({unit})")


def headline(timeline: Timeline) -> str:
    """`DualPipe · 8 ranks · 16 microbatches · bubble 12.3%`."""
    return (f"{st.display_name(timeline.schedule_name)} \u00b7 {timeline.num_ranks} ranks \u00b7 "
            f"{timeline.num_microbatches} microbatches \u00b7 bubble {timeline.bubble_ratio:.1%}")


def subtitle(timeline: Timeline) -> str:
    """Where the numbers come from: simulated or measured, and the makespan with its unit."""
    return (f"{timeline.source} \u00b7 makespan {timeline.makespan:.4g} {timeline.unit} \u00b7 "
            f"peak live activations {max_peak(timeline)} \u00b7 idle share per rank at the right")


def max_peak(timeline: Timeline) -> int:
    """The highest per-rank peak of live activations."""
    return max(timeline.peak_activations(r) for r in range(timeline.num_ranks))


def _timeline_figure(timeline: Timeline, activations: bool, transfers: bool | Schedule | None,
                     title: str | None) -> Figure:
    ranks = timeline.num_ranks
    gantt_h = max(1.0, ROW_IN * ranks)
    act_h = max(0.9, ACT_ROW_IN * ranks) if activations else 0.0
    top, bottom, gap = 0.95, 0.5, 0.42
    height = top + gantt_h + (gap + act_h if activations else 0.0) + bottom
    fig = st.new_figure(FIG_WIDTH, height, DPI)
    height = fig.get_size_inches()[1]
    width = FIG_WIDTH - LEFT_IN - RIGHT_IN
    ax = st.new_axes(fig, (LEFT_IN, height - top - gantt_h, width, gantt_h))
    scale, unit = st.time_scale(timeline)
    frame = frame_of(timeline, scale)
    dirs = st.directions_of(timeline.events, ranks)
    draw_gantt(ax, timeline, frame, dirs, transfers=transfers)
    last = ax
    if activations:
        last = st.new_axes(fig, (LEFT_IN, bottom, width, act_h))
        last.sharex(ax)
        ax.tick_params(labelbottom=False)
        draw_activations(last, timeline, frame)
    last.set_xlabel(f"time ({unit})", fontsize=9)
    fig.text(0.5, 1 - 0.1 / height, title or headline(timeline), ha="center", va="top", fontsize=12,
             fontweight="bold")
    fig.text(0.5, 1 - 0.36 / height, subtitle(timeline), ha="center", va="top", fontsize=8.5, color="#555555")
    entries = st.legend_entries(*st.timeline_kinds([timeline]), dirs)
    st.add_legend(fig, 1 - (top - 0.03) / height, entries, fontsize=8)
    return fig


def _rank_axes(ax: Axes, ranks: int, fontsize: float) -> None:
    """One row per rank, top to bottom, with a light vertical time grid and no frame but the time axis."""
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=fontsize)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#D0D0D0", linewidth=0.5, linestyle=":", zorder=0)
    ax.set_axisbelow(True)


def draw_gantt(ax: Axes, timeline: Timeline, frame: Frame, dirs: st.Directions, *, panel: int = 0,
               transfers: bool | Schedule | None = None, idle_labels: bool = True) -> int:
    """Draw every event of `timeline` into `ax`; returns how many action boxes were drawn."""
    from matplotlib.patches import Rectangle

    ranks = timeline.num_ranks
    ax.set_xlim(0, frame.xmax)
    _rank_axes(ax, ranks, fontsize=8)
    end = frame.x(timeline.start + timeline.makespan)
    for r in range(ranks):
        ax.add_patch(Rectangle((frame.x(timeline.start), r - BOX_H / 2), end - frame.x(timeline.start), BOX_H,
                               facecolor=st.BAND_COLOR, edgecolor="none", zorder=0.5))
    fit = _LabelFit.of(ax, frame.xmax, ranks)
    for r in range(ranks):
        row = timeline.rank_events(r)
        for e, after in zip(row, row[1:] + [None], strict=True):
            visible = e.end if after is None else max(e.start, min(e.end, after.start))
            _draw_event(ax, e, frame, ranks, fit, panel, frame.x(visible))
    if idle_labels:
        _draw_idle_shares(ax, timeline)
    if transfers:
        schedule = transfers if isinstance(transfers, Schedule) else None
        draw_transfers(ax, transfer_pairs(timeline, schedule), frame, panel)
    return len(timeline.events)


@dataclass(frozen=True)
class _LabelFit:
    """Font size of box labels and the width (axis units) a label of n characters needs."""

    fontsize: float
    units_per_char: float
    pad: float

    @staticmethod
    def of(ax: Axes, xspan: float, rows: int) -> _LabelFit:
        fig: Any = ax.get_figure()
        while not hasattr(fig, "get_size_inches"):  # a SubFigure: its .figure is the root Figure
            fig = fig.figure
        w_in, h_in = fig.get_size_inches()
        pos = ax.get_position()
        row_pt = pos.height * h_in * 72 / rows
        fontsize = max(4.5, min(8.0, 0.5 * row_pt))
        units_per_pt = xspan / max(pos.width * w_in * 72, 1e-9)
        return _LabelFit(fontsize, 0.62 * fontsize * units_per_pt, 2.0 * units_per_pt)

    def fits(self, text: str, width: float) -> bool:
        return len(text) * self.units_per_char + self.pad <= width


def _draw_event(ax: Axes, event: Event, frame: Frame, ranks: int, fit: _LabelFit, panel: int,
                visible: float) -> None:
    """One box (a pair: two halves and an outline); labels only where the box is not covered by the next."""
    from matplotlib.patches import Rectangle

    x0, x1 = frame.x(event.start), frame.x(event.end)
    y = event.rank - BOX_H / 2
    parts = event.action.compute_parts()
    pair = event.action.op is Op.OVERLAP_F_B
    step = (x1 - x0) / len(parts)
    for i, part in enumerate(parts):
        fill = st.color_of(part, ranks)
        if pair:
            ax.add_patch(Rectangle((x0 + i * step, y), step, BOX_H, facecolor=fill, edgecolor="none", zorder=2))
        label = str(part.microbatch)
        lo, hi = x0 + i * step, min(x0 + (i + 1) * step, visible)
        if fit.fits(label, hi - lo):
            ax.text((lo + hi) / 2, event.rank, label, ha="center", va="center",
                    fontsize=fit.fontsize, color=st.text_color(fill), zorder=4, clip_on=True)
    gid = f"{st.BOX_GID}-{panel}-r{event.rank}-{_gid_token(event.action)}"
    if pair:
        box = Rectangle((x0, y), x1 - x0, BOX_H, fill=False, edgecolor=st.EDGE_COLOR, linewidth=0.9, zorder=3)
    else:
        box = Rectangle((x0, y), x1 - x0, BOX_H, facecolor=st.color_of(parts[0], ranks), edgecolor="white",
                        linewidth=0.6, zorder=2)
    box.set_gid(gid)
    ax.add_patch(box)


def _gid_token(action: Action) -> str:
    return "-".join(f"s{p.stage}{p.op.value}m{p.microbatch}" for p in action.compute_parts())


def _draw_idle_shares(ax: Axes, timeline: Timeline) -> None:
    span = timeline.makespan
    ax.annotate("idle", xy=(1.0, -0.5), xycoords=("axes fraction", "data"), xytext=(6, 2),
                textcoords="offset points", ha="left", va="bottom", fontsize=7.5, color="#555555",
                annotation_clip=False)
    for r in range(timeline.num_ranks):
        share = timeline.idle(r) / span if span > 0 else 0.0
        ax.annotate(f"{share:.1%}", xy=(1.0, r), xycoords=("axes fraction", "data"), xytext=(6, 0),
                    textcoords="offset points", ha="left", va="center", fontsize=7.5, annotation_clip=False)


def transfer_pairs(timeline: Timeline, schedule: Schedule | None = None) -> list[tuple[Event, Event, str]]:
    """(producer, consumer, "F" or "B") for every tensor that crosses ranks.

    Activations go from F of (stage, mb) to F of (next stage, mb), gradients from the B/I of
    (stage, mb) to the B/I of (previous stage, mb). Without a schedule the next stage is stage + 1.
    """
    index: dict[tuple[str, int, int], Event] = {}
    for e in timeline.events:
        for p in e.action.compute_parts():
            if p.op is Op.F:
                index[("F", p.stage, p.microbatch)] = e
            elif p.op in (Op.B, Op.I):
                index[("B", p.stage, p.microbatch)] = e
    pairs = []
    for (kind, stage, mb), src in sorted(index.items(), key=lambda kv: (kv[1].start, kv[0])):
        if schedule is None:
            peer: int | None = stage + 1 if kind == "F" else stage - 1
        else:
            peer = schedule.next_stage(stage) if kind == "F" else schedule.prev_stage(stage)
        dst = index.get((kind, peer, mb)) if peer is not None else None
        if dst is not None and dst.rank != src.rank:
            pairs.append((src, dst, kind))
    return pairs


def draw_transfers(ax: Axes, pairs: list[tuple[Event, Event, str]], frame: Frame, panel: int = 0) -> None:
    """One thin arrow per transfer, from the producer's end to the consumer's start."""
    from matplotlib.patches import FancyArrowPatch

    colors = {"F": st.KIND_COLORS["F"][1], "B": st.KIND_COLORS["B"][1]}
    for i, (src, dst, kind) in enumerate(pairs):
        down = dst.rank > src.rank
        y0 = src.rank + (BOX_H / 2 if down else -BOX_H / 2)
        y1 = dst.rank - (BOX_H / 2 if down else -BOX_H / 2)
        arrow = FancyArrowPatch((frame.x(src.end), y0), (frame.x(dst.start), y1), arrowstyle="-|>",
                                mutation_scale=5, linewidth=0.5, color=colors[kind], alpha=0.6,
                                shrinkA=0, shrinkB=0, zorder=5)
        arrow.set_gid(f"{st.ARROW_GID}-{panel}-{i}")
        ax.add_patch(arrow)


def draw_activations(ax: Axes, timeline: Timeline, frame: Frame) -> None:
    """Live activations per rank as one filled step strip per rank, on a common scale."""
    ranks = timeline.num_ranks
    peak = max(max_peak(timeline), 1)
    _rank_axes(ax, ranks, fontsize=7.5)
    end = frame.x(timeline.start + timeline.makespan)
    for r in range(ranks):
        xs, ys = _steps(timeline.activation_curve(r), frame, end)
        base = r + 0.42
        tops = [base - 0.84 * y / peak for y in ys]
        ax.axhline(base - 0.84, color="#E3E3E3", linewidth=0.5, zorder=0.5)
        ax.fill_between(xs, base, tops, step="post", color="#B7A6D9", linewidth=0, zorder=1)
        ax.step(xs, tops, where="post", color="#5B3F9E", linewidth=0.8, zorder=2)
        ax.annotate(f"peak {timeline.peak_activations(r)}", xy=(1.0, r), xycoords=("axes fraction", "data"),
                    xytext=(6, 0), textcoords="offset points", ha="left", va="center", fontsize=7.5,
                    annotation_clip=False)
    ax.set_title(f"live activations per rank (full strip = {peak}; a stage-microbatch is live from its F "
                 "to the end of its B or W)", fontsize=8.5, loc="left", color="#333333")


def _steps(curve: list[tuple[float, int]], frame: Frame, end: float) -> tuple[list[float], list[int]]:
    xs, ys = [frame.x(frame.origin)], [0]
    for t, live in curve:
        xs.append(frame.x(t))
        ys.append(live)
    xs.append(end)
    ys.append(ys[-1])
    return xs, ys
