"""The planner's figure: predicted step time against peak memory per rank, with the Pareto front and the cap."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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
    labels = [(f"{st.display_name(r.schedule)} M={r.microbatches}" + (f" ZeRO {r.zero}" if zero else ""),
               (r.peak_bytes / scale, r.step_s * 1e3)) for r in front]
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
    _label_front(fig, ax, labels)  # once the limits are final (the cap line may widen them)
    _fit_legend(fig, ax)
    if target is not None:
        fig.savefig(target, dpi=DPI)
    return fig


LABEL_OFFSETS = tuple((dx, dy) for step in range(8) for dy in (6 + 9 * step, -11 - 9 * step) for dx in (5, -5))
"""Where a front label may go, in points from its point, nearest first (left of it for a negative x: right-aligned);
a label moved past the nearest rows gets a thin line to its point."""


def _label_front(fig: Figure, ax: Axes, labels: Sequence[tuple[str, tuple[float, float]]]) -> None:
    """Each label at the first of LABEL_OFFSETS where it overlaps no label placed before it and stays inside the
    axes (the nearest when none is free); labels of close points once overlapped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(fig).get_renderer()
    inside = ax.get_window_extent(renderer)
    placed: list[Any] = []  # the text's box, not its leader line's

    def put(text: str, xy: tuple[float, float], dx: int, dy: int) -> Any:
        line = {"arrowprops": {"arrowstyle": "-", "color": "#999999", "linewidth": 0.5}} if abs(dy) > 11 else {}
        note = ax.annotate(text, xy, fontsize=7, xytext=(dx, dy), textcoords="offset points",
                           ha="left" if dx > 0 else "right", va="center", **line)  # type: ignore[arg-type]
        note.update_positions(renderer)
        return note

    for text, xy in labels:
        for dx, dy in LABEL_OFFSETS:
            note = put(text, xy, dx, dy)
            box = Text.get_window_extent(note, renderer)
            if not any(box.overlaps(other) for other in placed) and inside.x0 <= box.x0 and box.x1 <= inside.x1 \
                    and inside.y0 <= box.y0 and box.y1 <= inside.y1:
                break
            note.remove()
        else:
            box = Text.get_window_extent(put(text, xy, *LABEL_OFFSETS[0]), renderer)
        placed.append(box)


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
