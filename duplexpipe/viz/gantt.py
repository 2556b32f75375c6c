"""Gantt chart of one timeline: a box per action on a real time axis, idle shares, activations, transfers."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.timeline import Event, Timeline
from duplexpipe.viz import _style as st
from duplexpipe.viz._boxes import BOX_H, Box, LabelFit, draw_boxes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
PathOrAxes = Union[str, "os.PathLike[str]", "Axes", Sequence["Axes"], None]

DPI = 150
"""Resolution of saved raster figures (dots per inch)."""
FIG_WIDTH = 12.0
"""Figure width in inches."""
ROW_IN = 0.34
"""Height of one rank's row in the Gantt panel, inches (rows shrink once the panel reaches MAX_GANTT_IN)."""
ACT_ROW_IN = 0.24
"""Height of one rank's strip in the activations panel, inches (shrinks at MAX_ACT_IN)."""
MAX_GANTT_IN = 10.0
"""Most height the Gantt panel takes, inches: many ranks share it (the figure stays under ~2500 px)."""
MAX_ACT_IN = 4.0
"""Most height the activations panel takes, inches."""
MAX_ACT_ROWS = 128
"""Above this many ranks shown, the activations panel is left out (the subtitle says so)."""
LEFT_IN, RIGHT_IN = 0.8, 0.75
"""Margins for rank labels (left) and idle shares (right), inches."""
MIN_LABEL_PT = 7.0
"""Least vertical room, points, between two rank labels; rows closer than that are labelled sparsely."""


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


Curve = Sequence[tuple[float, float]]
"""(time in the timeline's unit, bytes) steps: the value holds from its time to the next."""


@dataclass(frozen=True)
class MemoryCurves:
    """Bytes over a step per rank, for the memory strip beside a timeline (`plot_timeline(memory=...)`)."""

    measured: Mapping[int, Curve]
    """rank -> what it held after each action (e.g. `MemoryReport.curve_of("activations")` of a measured step,
    on the measured timeline's clock), drawn filled."""
    predicted: Mapping[int, Curve] | None = None
    """rank -> the byte model's curve (e.g. `activation_bytes_curve` over the same timeline), drawn as a dashed
    line on the same scale; None: none."""
    what: str = "saved activations"
    """What the bytes are (the strip's title)."""


def activation_bytes_curve(timeline: Timeline, rank: int, stage_bytes: Sequence[float]) -> list[tuple[float, float]]:
    """The byte model's live activations on `rank` over `timeline` (one microbatch of stage s keeps
    `stage_bytes[s]` from the start of its F to the end of its B or W; releases first at equal times), as
    `Timeline.activation_curve` counts them."""
    deltas: list[tuple[float, float]] = []
    for e in timeline.rank_events(rank):
        for part in e.action.compute_parts():
            if part.op is Op.F:
                deltas.append((e.start, float(stage_bytes[part.stage])))
            elif part.op in (Op.B, Op.W):
                deltas.append((e.end, -float(stage_bytes[part.stage])))
    deltas.sort()
    curve, live = [], 0.0
    for t, d in deltas:
        live += d
        curve.append((t, live))
    return curve


@dataclass(frozen=True)
class View:
    """Which ranks and which stretch of time a Gantt panel shows."""

    ranks: tuple[int, ...] | None = None
    """The ranks drawn, top to bottom (None: every rank)."""
    window: tuple[float | None, float | None] | None = None
    """(start, end) on the time axis, in its units (0 = the first start); None ends: the timeline's ends."""

    def rows(self, timeline: Timeline) -> tuple[int, ...]:
        """The ranks shown for `timeline`."""
        return tuple(range(timeline.num_ranks)) if self.ranks is None else self.ranks

    def limits(self, frame: Frame) -> tuple[float, float]:
        """The x range shown (axis units)."""
        lo, hi = self.window or (None, None)
        return (0.0 if lo is None else lo, frame.xmax if hi is None else hi)


def check_view(timeline: Timeline, ranks: Sequence[int] | None, window: Any) -> View:
    """The View of `ranks` and `window` for `timeline`; ValueError naming a rank or window it cannot show."""
    shown: tuple[int, ...] | None = None
    if ranks is not None:
        shown = tuple(ranks)
        if not shown:
            raise ValueError("ranks to show must not be empty")
        bad = [r for r in shown if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < timeline.num_ranks]
        if bad:
            raise ValueError(f"cannot show rank(s) {bad}: {timeline.schedule_name!r} has ranks "
                             f"0..{timeline.num_ranks - 1}")
        if len(set(shown)) != len(shown):
            raise ValueError(f"ranks to show repeat a rank: {list(shown)}")
    if window is not None:
        lo, hi = window
        for end in (lo, hi):
            number = isinstance(end, (int, float)) and not isinstance(end, bool)
            if end is not None and not (number and math.isfinite(end)):
                raise ValueError(f"window ends must be finite numbers or None, got {window!r}")
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"window start must be before its end, got {lo} and {hi}")
        scale, unit = st.time_scale(timeline)
        if (lo is not None and lo >= timeline.makespan * scale) or (hi is not None and hi <= 0):
            raise ValueError(f"window {'' if lo is None else f'{lo:g}'}:{'' if hi is None else f'{hi:g}'} shows "
                             f"nothing: the time axis runs from 0 to {timeline.makespan * scale:.4g} {unit}")
    return View(shown, window)


def frame_of(timeline: Timeline, scale: float = 1.0, xmax: float | None = None) -> Frame:
    """The frame that puts the timeline's first start at 0."""
    return Frame(timeline.start, scale, timeline.makespan * scale if xmax is None else xmax)


def plot_timeline(timeline: Timeline, path_or_axes: PathOrAxes, *, activations: bool = False,
                  transfers: bool | Schedule | None = None, title: str | None = None,
                  ranks: Sequence[int] | None = None, window: tuple[float | None, float | None] | None = None,
                  memory: MemoryCurves | None = None) -> Figure | None:
    """Draw `timeline` as a Gantt chart: one row per rank, one box per compute action.

    `path_or_axes` is a file name (.png, .svg or .pdf: the figure is saved and returned), None
    (the figure is returned unsaved) or a matplotlib Axes to draw into (a pair of Axes when
    `activations` is set; returns None). `activations` adds a panel of live activations per rank
    (left out above MAX_ACT_ROWS ranks shown). `transfers` draws P2P transfer arrows: True infers
    them from consecutive stages, a Schedule takes the chains from its stage table. `ranks` draws
    only those ranks, in that order; `window` = (start, end) only that stretch of the time axis, in
    the axis's units (cost units, or ms / s as the axis label says), either end None for open.
    Simulated and measured timelines are both accepted; large ones are drawn batched (see `_boxes`).
    `memory` (with `activations`): the panel shows those byte curves per rank (measured filled, predicted dashed)
    instead of the count of live activations.
    """
    st.check_timeline(timeline)
    view = check_view(timeline, ranks, window)
    if _is_axes_like(path_or_axes):
        _plot_into_axes(timeline, path_or_axes, activations, transfers, title, view, memory)
        return None
    path = None if path_or_axes is None else os.fspath(path_or_axes)  # type: ignore[arg-type]
    if path is not None:
        st.check_figure_path(path)
    fig = _timeline_figure(timeline, activations, transfers, title, view, memory)
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
                    transfers: bool | Schedule | None, title: str | None, view: View,
                    memory: MemoryCurves | None = None) -> None:
    group = list(axes) if isinstance(axes, Sequence) else [axes]
    if len(group) != (2 if activations else 1):
        raise ValueError(f"activations={activations} needs {2 if activations else 1} Axes, got {len(group)}")
    scale, unit = st.time_scale(timeline)
    frame = frame_of(timeline, scale)
    dirs = st.directions_of(timeline.events, timeline.num_ranks)
    draw_gantt(group[0], timeline, frame, dirs, transfers=transfers, view=view)
    group[0].set_title(title or headline(timeline), fontsize=10)
    handles, labels = st.legend_entries(*st.timeline_kinds([timeline]), dirs)
    group[0].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=7,
                    frameon=False, handler_map={st.Swatch: st._swatch_handler()})
    if activations:
        _draw_lower(group[1], timeline, frame, view, memory)
    group[-1].set_xlabel(f"time ({unit})")


def headline(timeline: Timeline) -> str:
    """`DualPipe · 8 ranks · 16 microbatches · bubble 12.3%`."""
    return (f"{st.display_name(timeline.schedule_name)} \u00b7 {timeline.num_ranks} ranks \u00b7 "
            f"{timeline.num_microbatches} microbatches \u00b7 bubble {timeline.bubble_ratio:.1%}")


def subtitle(timeline: Timeline, view: View | None = None, note: str = "") -> str:
    """Where the numbers come from (simulated or measured), the makespan with its unit, and what is shown."""
    rows = (view or View()).rows(timeline)
    shown = "" if len(rows) == timeline.num_ranks else f" \u00b7 {len(rows)} of {timeline.num_ranks} ranks shown"
    if view is not None and view.window is not None:
        lo, hi = view.window
        shown += f" \u00b7 window {'' if lo is None else f'{lo:g}'}:{'' if hi is None else f'{hi:g}'}"
    return (f"{timeline.source} \u00b7 makespan {st.duration(timeline.makespan, timeline.unit)} \u00b7 "
            f"peak live activations {max_peak(timeline)} \u00b7 idle share per rank (whole run) at the right"
            f"{shown}{note}")


def max_peak(timeline: Timeline) -> int:
    """The highest per-rank peak of live activations."""
    return max(timeline.peak_activations(r) for r in range(timeline.num_ranks))


def _timeline_figure(timeline: Timeline, activations: bool, transfers: bool | Schedule | None,
                     title: str | None, view: View, memory: MemoryCurves | None = None) -> Figure:
    rows = len(view.rows(timeline))
    note = ""
    if activations and rows > MAX_ACT_ROWS:
        activations, note = False, f" \u00b7 activations panel left out above {MAX_ACT_ROWS} ranks shown"
    gantt_h = min(MAX_GANTT_IN, max(1.0, ROW_IN * rows))
    act_h = min(MAX_ACT_IN, max(0.9, ACT_ROW_IN * rows)) if activations else 0.0
    top, bottom, gap = 0.95, 0.5, 0.42
    height = top + gantt_h + (gap + act_h if activations else 0.0) + bottom
    fig = st.new_figure(FIG_WIDTH, height, DPI)
    height = fig.get_size_inches()[1]
    width = FIG_WIDTH - LEFT_IN - RIGHT_IN
    ax = st.new_axes(fig, (LEFT_IN, height - top - gantt_h, width, gantt_h))
    scale, unit = st.time_scale(timeline)
    frame = frame_of(timeline, scale)
    dirs = st.directions_of(timeline.events, timeline.num_ranks)
    draw_gantt(ax, timeline, frame, dirs, transfers=transfers, view=view)
    last = ax
    if activations:
        last = st.new_axes(fig, (LEFT_IN, bottom, width, act_h))
        last.sharex(ax)
        ax.tick_params(labelbottom=False)
        _draw_lower(last, timeline, frame, view, memory)
    last.set_xlabel(f"time ({unit})", fontsize=9)
    fig.text(0.5, 1 - 0.1 / height, title or headline(timeline), ha="center", va="top", fontsize=12,
             fontweight="bold")
    fig.text(0.5, 1 - 0.36 / height, subtitle(timeline, view, note), ha="center", va="top", fontsize=8.5,
             color="#555555")
    entries = st.legend_entries(*st.timeline_kinds([timeline]), dirs)
    st.add_legend(fig, 1 - (top - 0.03) / height, entries, fontsize=8)
    return fig


def _label_step(ax: Axes, rows: int) -> int:
    """Label every n-th row so that labels stay MIN_LABEL_PT apart."""
    fig: Any = ax.get_figure()
    while not hasattr(fig, "get_size_inches"):
        fig = fig.figure
    row_pt = ax.get_position().height * fig.get_size_inches()[1] * 72 / max(rows, 1)
    return max(1, math.ceil(MIN_LABEL_PT / max(row_pt, 1e-9)))


def _rank_axes(ax: Axes, rows: Sequence[int], fontsize: float) -> int:
    """One row per rank shown, top to bottom, with a light vertical time grid and no frame but the time
    axis; a dashed line where shown ranks skip some. Returns the labelling step (1: every row)."""
    count = len(rows)
    ax.set_ylim(count - 0.5, -0.5)
    step = _label_step(ax, count)
    ticks = range(0, count, step)
    ax.set_yticks(list(ticks), [f"rank {rows[i]}" for i in ticks], fontsize=fontsize)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#D0D0D0", linewidth=0.5, linestyle=":", zorder=0)
    ax.set_axisbelow(True)
    for i in range(1, count):
        if rows[i] != rows[i - 1] + 1:
            ax.axhline(i - 0.5, color="#888888", linewidth=0.6, linestyle="--", zorder=1)
    return step


def draw_gantt(ax: Axes, timeline: Timeline, frame: Frame, dirs: st.Directions, *, panel: int = 0,
               transfers: bool | Schedule | None = None, idle_labels: bool = True,
               view: View | None = None) -> int:
    """Draw the events of `timeline` in `view` (default: everything) into `ax`; returns how many action
    boxes were drawn."""
    from matplotlib.collections import PolyCollection

    view = view or View()
    rows = view.rows(timeline)
    lo, hi = view.limits(frame)
    ax.set_xlim(lo, hi)
    step = _rank_axes(ax, rows, fontsize=8)
    band_lo, band_hi = max(lo, frame.x(timeline.start)), min(hi, frame.x(timeline.start + timeline.makespan))
    bands = [((band_lo, i - BOX_H / 2), (band_lo, i + BOX_H / 2), (band_hi, i + BOX_H / 2), (band_hi, i - BOX_H / 2))
             for i in range(len(rows))]
    ax.add_collection(PolyCollection(bands, facecolors=st.BAND_COLOR, edgecolors="none", zorder=0.5),
                      autolim=False)
    boxes = _boxes_in(timeline, frame, rows, lo, hi)
    draw_boxes(ax, boxes, timeline.num_ranks, LabelFit.of(ax, hi - lo, len(rows)), panel)
    if idle_labels:
        _draw_idle_shares(ax, timeline, rows, step)
    if transfers:
        schedule = transfers if isinstance(transfers, Schedule) else None
        where = {r: i for i, r in enumerate(rows)}
        pairs = [(a, b, k) for a, b, k in transfer_pairs(timeline, schedule) if a.rank in where and b.rank in where]
        draw_transfers(ax, pairs, frame, panel, where)
    return len(boxes)


def _boxes_in(timeline: Timeline, frame: Frame, rows: Sequence[int], lo: float, hi: float) -> list[Box]:
    """The boxes of the events of `rows` that overlap [lo, hi] on the axis."""
    boxes: list[Box] = []
    for i, rank in enumerate(rows):
        row = timeline.rank_events(rank)
        for e, after in zip(row, row[1:] + [None], strict=True):
            x0, x1 = frame.x(e.start), frame.x(e.end)
            if x1 < lo or x0 > hi:
                continue
            visible = e.end if after is None else max(e.start, min(e.end, after.start))
            boxes.append(Box(e, i, x0, x1, frame.x(visible)))
    return boxes


def _draw_idle_shares(ax: Axes, timeline: Timeline, rows: Sequence[int], step: int) -> None:
    span = timeline.makespan
    ax.annotate("idle", xy=(1.0, -0.5), xycoords=("axes fraction", "data"), xytext=(6, 2),
                textcoords="offset points", ha="left", va="bottom", fontsize=7.5, color="#555555",
                annotation_clip=False)
    for i in range(0, len(rows), step):
        share = timeline.idle(rows[i]) / span if span > 0 else 0.0
        ax.annotate(f"{share:.1%}", xy=(1.0, i), xycoords=("axes fraction", "data"), xytext=(6, 0),
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


def draw_transfers(ax: Axes, pairs: list[tuple[Event, Event, str]], frame: Frame, panel: int = 0,
                   rows: dict[int, int] | None = None) -> None:
    """One thin arrow per transfer, from the producer's end to the consumer's start (`rows`: rank -> row)."""
    from matplotlib.patches import FancyArrowPatch

    colors = {"F": st.KIND_COLORS["F"][1], "B": st.KIND_COLORS["B"][1]}
    for i, (src, dst, kind) in enumerate(pairs):
        a, b = (src.rank, dst.rank) if rows is None else (rows[src.rank], rows[dst.rank])
        down = b > a
        y0 = a + (BOX_H / 2 if down else -BOX_H / 2)
        y1 = b - (BOX_H / 2 if down else -BOX_H / 2)
        arrow = FancyArrowPatch((frame.x(src.end), y0), (frame.x(dst.start), y1), arrowstyle="-|>",
                                mutation_scale=5, linewidth=0.5, color=colors[kind], alpha=0.6,
                                shrinkA=0, shrinkB=0, zorder=5)
        arrow.set_gid(f"{st.ARROW_GID}-{panel}-{i}")
        ax.add_patch(arrow)


def draw_activations(ax: Axes, timeline: Timeline, frame: Frame, view: View | None = None) -> None:
    """Live activations per rank shown as one filled step strip per rank, on a common scale."""
    rows = (view or View()).rows(timeline)
    curves = [timeline.activation_curve(r) for r in rows]
    peak = max(max((live for curve in curves for _, live in curve), default=0), 1)
    step = _rank_axes(ax, rows, fontsize=7.5)
    end = frame.x(timeline.start + timeline.makespan)
    for i, curve in enumerate(curves):
        xs, ys = _steps(curve, frame, end)
        base = i + 0.42
        tops = [base - 0.84 * y / peak for y in ys]
        ax.axhline(base - 0.84, color="#E3E3E3", linewidth=0.5, zorder=0.5)
        ax.fill_between(xs, base, tops, step="post", color="#B7A6D9", linewidth=0, zorder=1)
        ax.step(xs, tops, where="post", color="#5B3F9E", linewidth=0.8, zorder=2)
        if i % step == 0:
            top = max((live for _, live in curve), default=0)
            ax.annotate(f"peak {top}", xy=(1.0, i), xycoords=("axes fraction", "data"), xytext=(6, 0),
                        textcoords="offset points", ha="left", va="center", fontsize=7.5, annotation_clip=False)
    ax.set_title(f"live activations per rank (full strip = {peak}; a stage-microbatch is live from its F "
                 "to the end of its B or W)", fontsize=8.5, loc="left", color="#333333")


def _steps(curve: Sequence[tuple[float, float]], frame: Frame, end: float) -> tuple[list[float], list[float]]:
    xs, ys = [frame.x(frame.origin)], [0.0]
    for t, live in curve:
        xs.append(frame.x(t))
        ys.append(live)
    xs.append(end)
    ys.append(ys[-1])
    return xs, ys


def _draw_lower(ax: Axes, timeline: Timeline, frame: Frame, view: View, memory: MemoryCurves | None) -> None:
    if memory is None:
        draw_activations(ax, timeline, frame, view)
    else:
        draw_memory(ax, timeline, frame, memory, view)


def draw_memory(ax: Axes, timeline: Timeline, frame: Frame, memory: MemoryCurves, view: View | None = None) -> None:
    """Bytes per rank as one strip per rank on a common scale: the measured curve filled, the predicted one dashed,
    each strip annotated with both peaks."""
    rows = (view or View()).rows(timeline)
    predicted = memory.predicted or {}
    measured = {r: list(memory.measured.get(r, ())) for r in rows}
    model = {r: list(predicted.get(r, ())) for r in rows}
    peak = max([1.0] + [b for c in (*measured.values(), *model.values()) for _, b in c])
    step = _rank_axes(ax, rows, fontsize=7.5)
    end = frame.x(timeline.start + timeline.makespan)
    for i, rank in enumerate(rows):
        base = i + 0.42
        ax.axhline(base - 0.84, color="#E3E3E3", linewidth=0.5, zorder=0.5)
        if measured[rank]:
            xs, ys = _steps(measured[rank], frame, end)
            tops = [base - 0.84 * y / peak for y in ys]
            ax.fill_between(xs, base, tops, step="post", color="#A9CCE3", linewidth=0, zorder=1)
            ax.step(xs, tops, where="post", color="#1F618D", linewidth=0.8, zorder=2)
        if model[rank]:
            xs, ys = _steps(model[rank], frame, end)
            ax.step(xs, [base - 0.84 * y / peak for y in ys], where="post", color="#C0392B", linewidth=0.9,
                    linestyle="--", zorder=3)
        if i % step == 0:
            tops = [max((b for _, b in c), default=0.0) for c in (measured[rank], model[rank]) if c]
            ax.annotate(_bytes(*tops), xy=(1.0, i), xycoords=("axes fraction", "data"), xytext=(6, 0),
                        textcoords="offset points", ha="left", va="center", fontsize=7, annotation_clip=False)
    both = "measured (filled) and predicted (dashed)" if predicted else "measured"
    ax.set_title(f"{memory.what} per rank, bytes: {both}, peaks at the right (full strip = {_bytes(peak)})",
                 fontsize=8.5, loc="left", color="#333333")


def _bytes(*values: float) -> str:
    """`values` in one unit, "/"-separated: `4.0/3.9 KiB`."""
    top, scale, unit = max(values, default=0.0), 1.0, "B"
    for name in ("KiB", "MiB", "GiB"):
        if top < 1024 * scale:
            break
        scale, unit = scale * 1024, name
    digits = 0 if unit == "B" else 1
    return "/".join(f"{v / scale:.{digits}f}" for v in values) + f" {unit}"
