"""Action boxes of a Gantt panel: one patch per box for small charts, batched collections for large ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.timeline import Event
from duplexpipe.viz import _style as st

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BOX_H = 0.8
"""Box height as a fraction of a row."""
DETAIL_LIMIT = 1500
"""Up to this many boxes a panel draws one patch per box (each with its own gid, one SVG element
per action); above it, the boxes of a panel are batched into a few collections (fast at any scale)."""
LABEL_LIMIT = 3000
"""Most microbatch labels one panel writes; above it (boxes too many to read) none are written."""


@dataclass(frozen=True)
class Box:
    """One event placed on the axes: its row, its x extent and the part not hidden by the next event."""

    event: Event
    """What ran."""
    row: int
    """The row it is drawn in (0 at the top)."""
    x0: float
    """Left end (axis units)."""
    x1: float
    """Right end (axis units)."""
    visible: float
    """Right end of the part not covered by the rank's next event (labels go only there)."""


@dataclass(frozen=True)
class LabelFit:
    """Font size of box labels and the width (axis units) a label of n characters needs."""

    fontsize: float
    """Label font size in points."""
    units_per_char: float
    """Axis units one character takes."""
    pad: float
    """Axis units of margin a label needs."""
    units_per_pt: float
    """Axis units per typographic point along x."""

    @staticmethod
    def of(ax: Axes, xspan: float, rows: int) -> LabelFit:
        """The fit for `rows` rows over `xspan` axis units in `ax`."""
        fig: Any = ax.get_figure()
        while not hasattr(fig, "get_size_inches"):  # a SubFigure: its .figure is the root Figure
            fig = fig.figure
        w_in, h_in = fig.get_size_inches()
        pos = ax.get_position()
        row_pt = pos.height * h_in * 72 / max(rows, 1)
        fontsize = max(4.5, min(8.0, 0.5 * row_pt))
        units_per_pt = xspan / max(pos.width * w_in * 72, 1e-9)
        return LabelFit(fontsize, 0.62 * fontsize * units_per_pt, 2.0 * units_per_pt, units_per_pt)

    def fits(self, text: str, width: float) -> bool:
        """True when `text` can be written inside `width` axis units."""
        return len(text) * self.units_per_char + self.pad <= width


def draw_boxes(ax: Axes, boxes: Sequence[Box], num_ranks: int, fit: LabelFit, panel: int) -> None:
    """Draw `boxes` (patches up to DETAIL_LIMIT, collections above) and the labels that fit."""
    if len(boxes) <= DETAIL_LIMIT:
        for box in boxes:
            _draw_patch(ax, box, num_ranks, panel)
    else:
        _draw_batched(ax, boxes, num_ranks, fit, panel)
    if not boxes or not fit.fits("0", max(box.x1 - box.x0 for box in boxes)):
        return  # not even one digit fits the widest box
    labels = [(box, part, lo, hi) for box in boxes for part, lo, hi in _label_spans(box)
              if fit.fits(str(part.microbatch), hi - lo)]
    if len(labels) > LABEL_LIMIT:
        return
    for box, part, lo, hi in labels:
        ax.text((lo + hi) / 2, box.row, str(part.microbatch), ha="center", va="center", fontsize=fit.fontsize,
                color=st.text_color(st.color_of(part, num_ranks)), zorder=4, clip_on=True)


def _label_spans(box: Box) -> list[tuple[Action, float, float]]:
    """(part, left, right) of each part's visible stretch."""
    parts = box.event.action.compute_parts()
    step = (box.x1 - box.x0) / len(parts)
    return [(part, box.x0 + i * step, min(box.x0 + (i + 1) * step, box.visible)) for i, part in enumerate(parts)]


def _draw_patch(ax: Axes, box: Box, num_ranks: int, panel: int) -> None:
    """One box (a pair: two halves and an outline) as patches, the box carrying a gid."""
    from matplotlib.patches import Rectangle

    x0, x1, y = box.x0, box.x1, box.row - BOX_H / 2
    action = box.event.action
    parts = action.compute_parts()
    pair = action.op is Op.OVERLAP_F_B
    if pair:
        step = (x1 - x0) / len(parts)
        for i, part in enumerate(parts):
            ax.add_patch(Rectangle((x0 + i * step, y), step, BOX_H, facecolor=st.color_of(part, num_ranks),
                                   edgecolor="none", zorder=2))
        patch = Rectangle((x0, y), x1 - x0, BOX_H, fill=False, edgecolor=st.EDGE_COLOR, linewidth=0.9, zorder=3)
    else:
        patch = Rectangle((x0, y), x1 - x0, BOX_H, facecolor=st.color_of(parts[0], num_ranks), edgecolor="white",
                          linewidth=0.6, zorder=2)
    patch.set_gid(f"{st.BOX_GID}-{panel}-r{box.event.rank}-{gid_token(action)}")
    ax.add_patch(patch)


def gid_token(action: Action) -> str:
    """The part of a box's gid that names its action: `s0Fm7-s7Bm3` for a pair."""
    return "-".join(f"s{p.stage}{p.op.value}m{p.microbatch}" for p in action.compute_parts())


def _draw_batched(ax: Axes, boxes: Sequence[Box], num_ranks: int, fit: LabelFit, panel: int) -> None:
    """All boxes as one collection of filled rectangles (pair halves included), pair outlines as a second.

    White edges and pair outlines are drawn only where boxes are wide enough to show them.
    """
    from matplotlib.collections import PolyCollection

    fills: list[tuple[float, float, float]] = []
    colors: list[str] = []
    outlines: list[tuple[float, float, float]] = []
    for box in boxes:
        parts = box.event.action.compute_parts()
        step = (box.x1 - box.x0) / len(parts)
        for i, part in enumerate(parts):
            fills.append((box.x0 + i * step, step, box.row))
            colors.append(st.color_of(part, num_ranks))
        if len(parts) > 1:
            outlines.append((box.x0, box.x1 - box.x0, box.row))
    widths = sorted(w for _, w, _ in fills)
    wide = widths[len(widths) // 2] / max(fit.units_per_pt, 1e-12) >= 3.0  # median box >= 3 points
    import numpy as np
    from matplotlib.colors import to_rgba

    palette = sorted(set(colors))
    index = {c: i for i, c in enumerate(palette)}
    rgba = np.array([to_rgba(c) for c in palette])[[index[c] for c in colors]]
    coll = PolyCollection(_rects(fills), facecolors=rgba, edgecolors="white" if wide else "none",
                          linewidths=0.4 if wide else 0.0, zorder=2, antialiased=wide)
    coll.set_gid(f"{st.BOX_GID}es-{panel}")
    ax.add_collection(coll, autolim=False)
    if outlines and wide:
        ax.add_collection(PolyCollection(_rects(outlines), facecolors="none", edgecolors=st.EDGE_COLOR,
                                         linewidths=0.6, zorder=3), autolim=False)


def _rects(spans: list[tuple[float, float, float]]) -> Any:
    """(n, 4, 2) corner array of rectangles given as (x, width, row)."""
    import numpy as np

    table = np.asarray(spans, dtype=float).reshape(-1, 3)
    x, w, y = table[:, 0], table[:, 1], table[:, 2] - BOX_H / 2
    return np.stack([np.stack([x, y], 1), np.stack([x, y + BOX_H], 1), np.stack([x + w, y + BOX_H], 1),
                     np.stack([x + w, y], 1)], 1)
