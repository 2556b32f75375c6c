"""The planner's figure: predicted step time against peak memory per rank, with the Pareto front and the cap."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from duplexpipe.planner.plan import PlanResult, PlanRow
from duplexpipe.sizes import format_bytes
from duplexpipe.viz import _style as st

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 150
WIDTH_IN, HEIGHT_IN = 8.0, 5.0
AXES_IN = (0.8, 0.6, 4.96, 3.9)
"""The axes' (left, bottom, width, height) in inches; the legend goes right of them."""
RIGHT_MARGIN_IN = 0.15
"""Room kept right of the legend."""


def pareto_front(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """The rows no other row beats on both step time and peak memory, by increasing peak memory."""
    front: list[PlanRow] = []
    for row in sorted(rows, key=lambda r: (r.peak_bytes, r.step_s)):
        if not front or row.step_s < front[-1].step_s:
            front.append(row)
    return front


def plot_pareto(result: PlanResult, path: str | os.PathLike[str] | None) -> Figure:
    """Every simulated candidate as a point (fitting ones filled, over-cap ones hollow), the Pareto front of
    the fitting ones as a line with labels, the cap as a vertical line and the best plan starred.

    `path` ends in .png, .svg or .pdf (None: return the figure unsaved).
    """
    target = None if path is None else os.fspath(path)
    if target is not None:
        st.check_figure_path(target)
    timed = [r for r in result.rows if r.peak_bytes == r.peak_bytes and r.step_s == r.step_s]
    fits = [r for r in timed if r.feasible]
    over = [r for r in timed if not r.feasible]
    unit, scale = _unit(max(r.peak_bytes for r in timed))
    fig = st.new_figure(WIDTH_IN, HEIGHT_IN, DPI)
    ax = st.new_axes(fig, AXES_IN)
    names = sorted({r.schedule for r in timed})
    colors = {name: f"C{k % 10}" for k, name in enumerate(names)}
    for name in names:
        mine = [r for r in fits if r.schedule == name]
        ax.scatter([r.peak_bytes / scale for r in mine], [r.step_s * 1e3 for r in mine], s=22,
                   color=colors[name], label=st.display_name(name) if mine else None, zorder=3)
        gone = [r for r in over if r.schedule == name]
        ax.scatter([r.peak_bytes / scale for r in gone], [r.step_s * 1e3 for r in gone], s=22,
                   facecolors="none", edgecolors=colors[name], linewidths=0.8, zorder=2,
                   label=None if mine or not gone else st.display_name(name))
    if over:
        ax.scatter([], [], s=22, facecolors="none", edgecolors="#666666", label="hollow: over the cap")
    front = pareto_front(fits)
    ax.plot([r.peak_bytes / scale for r in front], [r.step_s * 1e3 for r in front], color="#444444",
            linewidth=1.0, zorder=1, label="Pareto front")
    zero = result.config.dp > 1  # with data parallelism the ZeRO stages are different plans
    for k, r in enumerate(front):  # labels alternate above and below the front so neighbours do not collide
        ax.annotate(f"{st.display_name(r.schedule)} M={r.microbatches}" + (f" ZeRO {r.zero}" if zero else ""),
                    (r.peak_bytes / scale, r.step_s * 1e3), fontsize=7, xytext=(5, 6 if k % 2 == 0 else -11),
                    textcoords="offset points")
    best = result.best
    ax.scatter([best.peak_bytes / scale], [best.step_s * 1e3], marker="*", s=180, color="gold",
               edgecolors="black", zorder=4, label=f"best: {st.display_name(best.schedule)} M={best.microbatches}")
    ax.axvline(result.config.memory / scale, color="#C0392B", linestyle="--", linewidth=1.0,
               label=f"cap {format_bytes(result.config.memory)}")
    ax.set_xlabel(f"predicted peak memory per rank ({unit})")
    ax.set_ylabel("predicted step time (ms)")
    c = result.config
    ax.set_title(f"Plans for P={c.ranks} x D={c.dp}, batch {c.batch}: step time vs memory", fontsize=10)
    ax.grid(True, linewidth=0.3, alpha=0.6)
    _fit_legend(fig, ax)
    if target is not None:
        fig.savefig(target, dpi=DPI)
    return fig


def _fit_legend(fig: Figure, ax: Axes) -> None:
    """The legend right of the axes, in two columns when one would be taller than the axes, and the figure
    widened (the axes kept in place) until the whole legend is inside it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
    if legend.get_window_extent(renderer).height > ax.get_window_extent(renderer).height:
        legend.remove()
        legend = ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False, ncols=2)
    needed = legend.get_window_extent(renderer).x1 / fig.dpi + RIGHT_MARGIN_IN
    width, height = fig.get_size_inches()
    if needed > width:
        fig.set_size_inches(round(needed * fig.dpi) / fig.dpi, height)
        left, bottom, w, h = AXES_IN
        new = fig.get_size_inches()[0]
        ax.set_position((left / new, bottom / height, w / new, h / height))


def _unit(largest: float) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return unit, float(size)
    return "B", 1.0
