"""Shared look of every figure: colours per action kind, direction shading, names and legend swatches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from duplexpipe.schedules.ir import Action, Op, format_action
from duplexpipe.schedules.timeline import Event, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

KINDS = ("F", "B", "I", "W")
"""The plain compute kinds in legend order."""

KIND_NAMES: Mapping[str, str] = MappingProxyType({
    "F": "F forward", "B": "B backward", "I": "I input-grad", "W": "W weight-grad",
})

KIND_COLORS: Mapping[str, tuple[str, str]] = MappingProxyType({
    # kind: (first direction / leg, second direction / leg)
    "F": ("#8DBBE3", "#2C64A6"),
    "B": ("#F6B26B", "#BD5E12"),
    "I": ("#F09AA8", "#A9354F"),
    "W": ("#9AD39F", "#2F7D3D"),
})

DISPLAY_NAMES: Mapping[str, str] = MappingProxyType({
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B", "interleaved-1f1b": "Interleaved 1F1B",
    "zb-h1": "ZB-H1", "zbh1": "ZB-H1", "zb1p": "ZB-H1", "zb-h2": "ZB-H2", "zbv": "ZB-V", "zb-v": "ZB-V",
    "dualpipe": "DualPipe", "dualpipev": "DualPipeV", "dualpipe-v": "DualPipeV",
    "v-half": "V-Half", "v-min": "V-Min",
})

BOX_GID = "dpbox"
"""Every drawn action box carries a gid starting with this (one per compute action)."""
ARROW_GID = "dparrow"
"""Every drawn P2P transfer arrow carries a gid starting with this."""
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
BAND_COLOR = "#ECECEC"
EDGE_COLOR = "#333333"


def display_name(name: str) -> str:
    """The human spelling of a registry name (`dualpipe` -> `DualPipe`); unknown names pass through."""
    return DISPLAY_NAMES.get(name.lower(), name)


def kind_of(action: Action) -> str:
    """`F`, `B`, `I`, `W` or `F&B`."""
    return "F&B" if action.op is Op.OVERLAP_F_B else action.op.value


def shade_of(stage: int, num_ranks: int) -> int:
    """0 for the first direction (stage < P), 1 for the second (the next P stages), alternating after."""
    return (stage // num_ranks) % 2


def color_of(part: Action, num_ranks: int) -> str:
    """Fill colour of one plain compute action."""
    return KIND_COLORS[part.op.value][shade_of(part.stage, num_ranks)]


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on `fill` (a #RRGGBB colour)."""
    r, g, b = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def short_token(action: Action) -> str:
    """Compact text of an action: `2F3`, a pair as `0F7&7B3`, comm actions in full."""
    if action.op is Op.OVERLAP_F_B:
        return "&".join(format_action(p) for p in action.parts)
    return format_action(action)


@dataclass(frozen=True)
class Directions:
    """How the two shades of a timeline read: which stages go which way."""

    mode: str
    """"none" (one direction), "dual" (DualPipe copies), "vshape" (V legs) or "chunks" (interleaved)."""
    labels: tuple[str, str]
    """Legend text of the first and the second shade."""


def directions_of(events: Iterable[Event], num_ranks: int) -> Directions:
    """Infer from the stages present what the light and dark shades mean."""
    parts = [(e.rank, p) for e in events for p in e.action.compute_parts()]
    high = [(r, p) for r, p in parts if p.stage >= num_ranks]
    if not high:
        return Directions("none", ("", ""))
    p_last = num_ranks - 1
    if max(p.stage for _, p in high) >= 2 * num_ranks:
        return Directions("chunks", ("even chunks (stage // P even)", "odd chunks (stage // P odd)"))
    low_mbs = {p.microbatch for _, p in parts if p.stage < num_ranks}
    high_mbs = {p.microbatch for _, p in high}
    if low_mbs and not low_mbs & high_mbs:
        return Directions("dual", (f"\u2193 down: microbatches {_span(low_mbs)}",
                                   f"\u2191 up: microbatches {_span(high_mbs)}"))
    if all(r == 2 * num_ranks - 1 - p.stage for r, p in high):
        return Directions("vshape", (f"V leg 1: stages 0\u2013{p_last}",
                                     f"V leg 2: stages {num_ranks}\u2013{2 * num_ranks - 1}"))
    return Directions("chunks", (f"chunk 0: stages 0\u2013{p_last}",
                                 f"chunk 1: stages {num_ranks}\u2013{2 * num_ranks - 1}"))


def _span(values: set[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}\u2013{hi}" if hi > lo else str(lo)


def merge_directions(all_dirs: Sequence[Directions]) -> Directions:
    """One legend key for several panels (a comparison figure)."""
    modes = {d.mode for d in all_dirs} - {"none"}
    if not modes:
        return Directions("none", ("", ""))
    if len(modes) == 1:
        return next(d for d in all_dirs if d.mode in modes)
    words = {"dual": ("DualPipe \u2193 copy", "DualPipe \u2191 copy"), "vshape": ("V leg 1", "V leg 2"),
             "chunks": ("chunk 0", "chunk 1")}
    order = [m for m in ("dual", "vshape", "chunks") if m in modes]
    return Directions("mixed", ("light: " + " / ".join(words[m][0] for m in order),
                                "dark: " + " / ".join(words[m][1] for m in order)))


def timeline_kinds(timelines: Iterable[Timeline]) -> tuple[set[str], bool]:
    """The plain kinds present (pair parts included) and whether any F&B pair is present."""
    kinds: set[str] = set()
    pairs = False
    for tl in timelines:
        for e in tl.events:
            pairs = pairs or e.action.op is Op.OVERLAP_F_B
            kinds.update(p.op.value for p in e.action.compute_parts())
    return kinds, pairs


@dataclass(frozen=True)
class Swatch:
    """A legend key made of side-by-side colour blocks."""

    colors: tuple[str, ...]
    """Fill colours, left to right."""
    outline: bool = False
    """Draw a dark outline around the whole key (used for F&B pairs)."""


def legend_entries(kinds: set[str], pairs: bool, dirs: Directions) -> tuple[list[Swatch], list[str]]:
    """Legend handles and labels: one per kind present, the F&B pair, then the two shades."""
    two = dirs.mode != "none"
    handles: list[Swatch] = []
    labels: list[str] = []
    for kind in KINDS:
        if kind in kinds:
            handles.append(Swatch(KIND_COLORS[kind] if two else KIND_COLORS[kind][:1]))
            labels.append(KIND_NAMES[kind])
    if pairs:
        handles.append(Swatch((KIND_COLORS["F"][0], KIND_COLORS["B"][0]), outline=True))
        labels.append("F&B overlapped pair")
    if two:
        handles += [Swatch(("#D9D9D9",)), Swatch(("#6E6E6E",))]
        labels += [dirs.labels[0], dirs.labels[1]]
    return handles, labels


def add_legend(fig: Figure, anchor_y: float, entries: tuple[list[Swatch], list[str]], fontsize: float) -> None:
    """Put the legend in one centred row above `anchor_y` (figure fraction)."""
    handles, labels = entries
    if not handles:
        return
    swatches: Any = handles  # drawn by the Swatch handler, not Artists
    fig.legend(swatches, labels, loc="lower center", bbox_to_anchor=(0.5, anchor_y), ncol=len(handles),
               frameon=False, fontsize=fontsize, handler_map={Swatch: _swatch_handler()},
               handlelength=2.2, handleheight=1.0, columnspacing=1.4, handletextpad=0.5)


def _swatch_handler() -> Any:
    from matplotlib.legend_handler import HandlerBase
    from matplotlib.patches import Rectangle

    class _Handler(HandlerBase):
        def create_artists(self, legend: Any, orig_handle: Any, xdescent: float, ydescent: float,
                           width: float, height: float, fontsize: float, trans: Any) -> list[Any]:
            swatch: Swatch = orig_handle
            step = width / len(swatch.colors)
            artists: list[Any] = [
                Rectangle((-xdescent + i * step, -ydescent), step, height, facecolor=c, edgecolor="none",
                          transform=trans)
                for i, c in enumerate(swatch.colors)
            ]
            artists.append(Rectangle((-xdescent, -ydescent), width, height, fill=False, transform=trans,
                                     edgecolor=EDGE_COLOR if swatch.outline else "#999999",
                                     linewidth=1.0 if swatch.outline else 0.4))
            return artists

    return _Handler()


SECONDS = ("s", "sec", "secs", "second", "seconds")
"""Unit names of measured timelines."""


def duration(value: float, unit: str) -> str:
    """A time for a title: seconds below 1 s in ms, with 3 significant digits ("55.4 ms", "1.23 s"); cost units as
    given ("12 units")."""
    if unit.strip().lower() in SECONDS:
        return f"{value * 1e3:.3g} ms" if abs(value) < 1.0 else f"{value:.3g} s"
    return f"{value:.4g} {unit}".rstrip()


def time_scale(timeline: Timeline) -> tuple[float, str]:
    """(factor, axis unit) to draw `timeline` in: seconds become ms below 1 s; other units stay."""
    unit = timeline.unit.strip()
    if unit.lower() in SECONDS and timeline.makespan < 1.0:
        return 1000.0, "ms"
    return 1.0, unit


def check_figure_path(path: str) -> str:
    """The lower-case suffix of `path` if it is a supported figure format, else ValueError."""
    import os

    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FIGURE_SUFFIXES:
        raise ValueError(f"unsupported figure format {suffix or '(none)'!r} for {path!r}: "
                         f"use one of {', '.join(FIGURE_SUFFIXES)}")
    return suffix


def check_timeline(timeline: Any, what: str = "timeline") -> Timeline:
    """`timeline` if it is a Timeline with events, else ValueError."""
    if not isinstance(timeline, Timeline):
        raise ValueError(f"{what} must be a Timeline, got {type(timeline).__name__}")  # noqa: TRY004
    if not timeline.events:
        raise ValueError(f"{what} {timeline.schedule_name!r} has no events to draw")
    stray = sorted({e.rank for e in timeline.events if not 0 <= e.rank < timeline.num_ranks})
    if stray:
        raise ValueError(f"{what} {timeline.schedule_name!r} has events on ranks {stray}, "
                         f"outside 0..{timeline.num_ranks - 1}")
    return timeline


def new_figure(width_in: float, height_in: float, dpi: int) -> Figure:
    """A pyplot-free Figure (no GUI backend involved) whose size is a whole number of pixels at `dpi`."""
    from matplotlib.figure import Figure

    return Figure(figsize=(round(width_in * dpi) / dpi, round(height_in * dpi) / dpi), dpi=dpi)


def new_axes(fig: Figure, rect_in: tuple[float, float, float, float]) -> Axes:
    """An axes at (left, bottom, width, height) given in inches from the figure's lower left."""
    w, h = fig.get_size_inches()
    left, bottom, width, height = rect_in
    return fig.add_axes((left / w, bottom / h, width / w, height / h))
