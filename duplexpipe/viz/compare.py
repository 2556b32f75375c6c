"""Stacked Gantt panels on one time axis: schedules side by side, and a measured run beside its simulation."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duplexpipe.schedules.timeline import Timeline
from duplexpipe.viz import _style as st
from duplexpipe.viz.gantt import DPI, FIG_WIDTH, LEFT_IN, RIGHT_IN, Frame, draw_gantt, max_peak

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
PANEL_ROW_IN = 0.3
"""Height of one rank's row in a stacked panel, inches (rows shrink once the panels reach MAX_STACK_IN)."""
MAX_STACK_IN = 16.0
"""Most height all panels of a stacked figure take together, inches (the figure stays under ~2800 px)."""


@dataclass(frozen=True)
class Panel:
    """One timeline in a stacked figure."""

    timeline: Timeline
    """What to draw."""
    frame: Frame
    """How its times map to the shared x axis."""
    name: str
    """Bold label above the panel."""
    stats: str
    """Plain text after the label (bubble ratio, peak activations, ...)."""


def plot_comparison(timelines: Sequence[Timeline], path: str | os.PathLike[str] | None, *,
                    title: str | None = None) -> Figure:
    """Stack several timelines on one shared time axis, each labelled with bubble ratio and peak activations.

    All timelines must share one unit. `path` ends in .png, .svg or .pdf (None: return unsaved).
    """
    tls = [st.check_timeline(t, f"timelines[{i}]") for i, t in enumerate(timelines)]
    if not tls:
        raise ValueError("plot_comparison needs at least one timeline, got none")
    units = sorted({t.unit for t in tls})
    if len(units) > 1:
        raise ValueError(f"plot_comparison needs timelines in one unit, got units {units}")
    target = _check_path(path)
    scale, shown = st.time_scale(max(tls, key=lambda t: t.makespan))
    xmax = max(t.makespan for t in tls) * scale
    panels = [Panel(t, Frame(t.start, scale, xmax), st.display_name(t.schedule_name),
                    f"bubble {t.bubble_ratio:.1%}  \u00b7  peak activations {max_peak(t)}  \u00b7  "
                    f"makespan {st.duration(t.makespan, t.unit)}  \u00b7  {t.num_ranks} ranks")
              for t in tls]
    shapes = sorted({(t.num_ranks, t.num_microbatches) for t in tls})
    default = "Pipeline schedules" + (f" \u00b7 {shapes[0][0]} ranks \u00b7 {shapes[0][1]} microbatches"
                                      if len(shapes) == 1 else "")
    note = f"{tls[0].source} \u00b7 one shared time axis \u00b7 idle share per rank at the right"
    fig = stacked_figure(panels, title or default, note, f"time ({shown})")
    if target is not None:
        fig.savefig(target, dpi=DPI)
    return fig


def plot_measured_vs_simulated(measured: Timeline, simulated: Timeline,
                               path: str | os.PathLike[str] | None) -> Figure:
    """Draw a measured run above its simulation on one time axis.

    Simulated cost units are scaled to the measured unit by one factor chosen so that the
    total compute time (busy time summed over ranks) of both is equal; the figure says so and
    gives the factor. A simulated timeline already in the measured unit (e.g. simulated with
    costs fitted to the run) is drawn unscaled.
    """
    st.check_timeline(measured, "measured")
    st.check_timeline(simulated, "simulated")
    if measured.num_ranks != simulated.num_ranks:
        raise ValueError(f"measured has {measured.num_ranks} ranks but simulated has {simulated.num_ranks}")
    target = _check_path(path)
    busy_m = sum(measured.busy(r) for r in range(measured.num_ranks))
    busy_s = sum(simulated.busy(r) for r in range(simulated.num_ranks))
    if busy_m <= 0 or busy_s <= 0:
        raise ValueError(f"both timelines need compute time, got measured {busy_m} and simulated {busy_s}")
    same_unit = measured.unit == simulated.unit  # e.g. simulated with costs fitted to the run
    factor = 1.0 if same_unit else busy_m / busy_s
    scale, shown = st.time_scale(measured)
    xmax = max(measured.makespan, simulated.makespan * factor) * scale
    unit = measured.unit
    panels = [
        Panel(measured, Frame(measured.start, scale, xmax), "measured",
              f"makespan {st.duration(measured.makespan, unit)}  \u00b7  bubble {measured.bubble_ratio:.1%}  \u00b7  "
              f"peak activations {max_peak(measured)}"),
        Panel(simulated, Frame(simulated.start, scale * factor, xmax), "simulated",
              f"makespan {_scaled(simulated.makespan, simulated.unit, factor, unit)}"
              f"  \u00b7  bubble {simulated.bubble_ratio:.1%}  \u00b7  peak activations {max_peak(simulated)}"),
    ]
    title = (f"{st.display_name(measured.schedule_name)}: measured vs simulated \u00b7 "
             f"{measured.num_ranks} ranks \u00b7 {measured.num_microbatches} microbatches")
    note = (f"simulated times scaled by 1 {simulated.unit.rstrip('s')} = {factor * scale:.4g} {shown} "
            "(equal total compute time), so both panels share the time axis")
    if same_unit:
        note = f"both in {unit} on one time axis; the simulation uses the costs it was given, unscaled"
    fig = stacked_figure(panels, title, note, f"time ({shown})")
    if target is not None:
        fig.savefig(target, dpi=DPI)
    return fig


def _scaled(value: float, unit: str, factor: float, shown: str) -> str:
    """A simulated time, and what it is in the measured unit when that differs ("12 units = 55.4 ms")."""
    if unit == shown:
        return st.duration(value, unit)
    return f"{st.duration(value, unit)} = {st.duration(value * factor, shown)}"


def _check_path(path: str | os.PathLike[str] | None) -> str | None:
    if path is None:
        return None
    target = os.fspath(path)
    st.check_figure_path(target)
    return target


def stacked_figure(panels: Sequence[Panel], title: str, note: str, xlabel: str) -> Figure:
    """A figure with one Gantt panel per entry, top to bottom, sharing the x axis and one legend."""
    top, bottom, head, gap = 0.95, 0.5, 0.26, 0.2
    share = MAX_STACK_IN / len(panels)
    heights = [max(0.6, min(share, PANEL_ROW_IN * p.timeline.num_ranks)) for p in panels]
    height = top + bottom + sum(heights) + len(panels) * head + (len(panels) - 1) * gap
    fig = st.new_figure(FIG_WIDTH, height, DPI)
    height = fig.get_size_inches()[1]
    width = FIG_WIDTH - LEFT_IN - RIGHT_IN
    cursor = height - top
    axes: list[Axes] = []
    dirs: list[st.Directions] = []
    for i, (panel, h) in enumerate(zip(panels, heights, strict=True)):
        cursor -= head + h
        ax = st.new_axes(fig, (LEFT_IN, cursor, width, h))
        if axes:
            ax.sharex(axes[0])
        d = st.directions_of(panel.timeline.events, panel.timeline.num_ranks)
        draw_gantt(ax, panel.timeline, panel.frame, d, panel=i)
        _panel_header(ax, panel)
        ax.tick_params(labelbottom=i == len(panels) - 1)
        axes.append(ax)
        dirs.append(d)
        cursor -= gap
    axes[-1].set_xlabel(xlabel, fontsize=9)
    fig.text(0.5, 1 - 0.1 / height, title, ha="center", va="top", fontsize=12, fontweight="bold")
    fig.text(0.5, 1 - 0.36 / height, note, ha="center", va="top", fontsize=8.5, color="#555555")
    entries = st.legend_entries(*st.timeline_kinds(p.timeline for p in panels), st.merge_directions(dirs))
    st.add_legend(fig, 1 - (top - 0.03) / height, entries, fontsize=8)
    return fig


def _panel_header(ax: Axes, panel: Panel) -> None:
    name = ax.annotate(panel.name, xy=(0.0, 1.0), xycoords="axes fraction",
                       xytext=(0, 3), textcoords="offset points", ha="left", va="bottom",
                       fontsize=9.5, fontweight="bold")
    ax.annotate(panel.stats, xy=(1.0, 0.0), xycoords=name,
                xytext=(10, 0), textcoords="offset points", ha="left", va="bottom", fontsize=8.5,
                color="#333333")
