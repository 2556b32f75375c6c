"""Plain-text views for terminals: a schedule's rank x step grid, a timeline's time-scaled rows."""

from __future__ import annotations

import math
from collections.abc import Sequence

from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.timeline import Event, Timeline
from duplexpipe.viz import _style as st

KEY = "key: F forward, B backward, I input-grad, W weight-grad; a&b = an overlapped F&B pair (OVERLAP_F_B)"
TIMELINE_WIDTH = 160
"""Most characters the time axis of a timeline view takes by default."""
IDLE_CHAR = "."


def render_text(schedule_or_timeline: Schedule | Timeline, *, width: int | None = None) -> str:
    """A text picture: for a Schedule one row per rank and one column per step (each rank's
    n-th action in column n, F&B pairs written `0F7&7B3`); for a Timeline one row per rank on a
    time axis, each action a box as long as it ran, idle time as dots.

    `width` limits the line length: a schedule grid wraps into blocks of steps, a timeline
    is scaled to fit (default: no wrapping; timelines up to 160 columns of time axis).
    """
    if width is not None and width < 40:
        raise ValueError(f"width must be >= 40 columns, got {width}")
    if isinstance(schedule_or_timeline, Schedule):
        return _schedule_grid(schedule_or_timeline, width)
    if isinstance(schedule_or_timeline, Timeline):
        return _timeline_rows(schedule_or_timeline, width)
    raise ValueError(f"render_text needs a Schedule or a Timeline, got {type(schedule_or_timeline).__name__}")


def _schedule_grid(schedule: Schedule, width: int | None) -> str:
    rows = [[st.short_token(a) for a in row] for row in schedule.actions]
    steps = max((len(r) for r in rows), default=0)
    widths = [max(len(r[j]) for r in rows if j < len(r)) for j in range(steps)]
    label = len(f"rank {schedule.num_ranks - 1}")
    copies = f" ({schedule.num_copies} copies)" if schedule.num_copies > 1 else ""
    title = (f"{st.display_name(schedule.name)} \u00b7 {schedule.num_ranks} ranks \u00b7 "
             f"{schedule.num_microbatches} microbatches \u00b7 {schedule.num_stages} stages{copies} \u00b7 "
             f"{'with comms' if schedule.has_comms else 'compute only'}")
    lines = [title]
    for lo, hi in _blocks(widths, label + 2, width):
        lines.append("")
        lines.append("step".ljust(label) + "  " + " ".join(str(j).ljust(widths[j]) for j in range(lo, hi)))
        for r, row in enumerate(rows):
            cells = [(row[j] if j < len(row) else "").ljust(widths[j]) for j in range(lo, hi)]
            lines.append(f"rank {r}".ljust(label) + "  " + " ".join(cells))
    lines += ["", KEY]
    return _join(lines, width)


def _join(lines: list[str], width: int | None) -> str:
    """The lines as one string; with a width, over-long prose lines (title, key) are wrapped."""
    import textwrap

    out: list[str] = []
    for line in lines:
        line = line.rstrip()
        out += textwrap.wrap(line, width) if width is not None and len(line) > width else [line]
    return "\n".join(out) + "\n"


def _blocks(widths: Sequence[int], indent: int, width: int | None) -> list[tuple[int, int]]:
    """Split the step columns into consecutive blocks that fit in `width` characters."""
    if width is None or not widths:
        return [(0, len(widths))]
    blocks, lo, used = [], 0, indent
    for j, w in enumerate(widths):
        if j > lo and used + 1 + w > width:
            blocks.append((lo, j))
            lo, used = j, indent
        used += w + (1 if j > lo else 0)
    blocks.append((lo, len(widths)))
    return blocks


def _timeline_rows(timeline: Timeline, width: int | None) -> str:
    span = timeline.makespan
    label = len(f"rank {timeline.num_ranks - 1}")
    head = (f"{st.display_name(timeline.schedule_name)} \u00b7 {timeline.num_ranks} ranks \u00b7 "
            f"{timeline.num_microbatches} microbatches \u00b7 bubble {timeline.bubble_ratio:.1%} \u00b7 "
            f"{timeline.source}, makespan {span:.4g} {timeline.unit}")
    if not timeline.events or span <= 0:
        return head + "\n(no events)\n"
    cols_max = TIMELINE_WIDTH if width is None else max(20, width - label - 10)
    shortest = min((e.duration for e in timeline.events if e.duration > 0), default=span)
    per_unit = min(5.0 / shortest, cols_max / span)
    if per_unit >= 1 and per_unit - math.floor(per_unit) < 0.25 * per_unit:
        per_unit = float(math.floor(per_unit))  # whole columns per unit: equal costs, equal boxes
    cols = max(1, round(span * per_unit))
    level = _detail_level(timeline, per_unit)
    lines = [head, "", "time".ljust(label) + "  " + _ruler(span, per_unit, cols) + "  idle"]
    for r in range(timeline.num_ranks):
        row, cursor = [IDLE_CHAR] * cols, 0
        for e in timeline.rank_events(r):
            cursor = _place(row, e, timeline.start, per_unit, level, cursor)
        share = timeline.idle(r) / span
        lines.append(f"rank {r}".ljust(label) + "  " + "".join(row) + f"  {share:.1%}")
    lines += ["", KEY + f"; '|' ends a box, '{IDLE_CHAR}' is idle"]
    return _join(lines, width)


def _labels(event: Event) -> tuple[str, str, str]:
    """A box's text from most to least detailed: `0F7&7B3`, `F7&B3`, `F&B`."""
    parts = event.action.compute_parts()
    return (st.short_token(event.action), "&".join(f"{p.op.value}{p.microbatch}" for p in parts),
            "&".join(p.op.value for p in parts))


def _detail_level(timeline: Timeline, per_unit: float) -> int:
    """The most detailed label form that fits in at least 3/4 of the boxes (one form per picture)."""
    sizes = [(round(e.duration * per_unit) - 1, _labels(e)) for e in timeline.events]
    for level in (0, 1):
        if sum(len(labels[level]) <= room for room, labels in sizes) >= 0.75 * len(sizes):
            return level
    return 2


def _place(row: list[str], event: Event, origin: float, per_unit: float, level: int, cursor: int) -> int:
    """Write the event's box into `row`, not left of `cursor` (so tiny events stay visible); returns its end."""
    lo = min(len(row) - 1, max(cursor, round((event.start - origin) * per_unit)))
    hi = min(len(row), max(lo + 1, round((event.end - origin) * per_unit)))
    n = hi - lo
    if n == 1:
        row[lo] = "X" if event.action.op is Op.OVERLAP_F_B else event.action.op.value
        return hi
    labels = _labels(event)
    text = next((c for c in labels[level:] if len(c) <= n - 1), labels[2][: n - 1])
    row[lo:hi] = list(text.ljust(n - 1) + "|")
    return hi


def _ruler(span: float, per_unit: float, cols: int) -> str:
    """Tick labels at round times, none closer than 8 columns to the previous one."""
    step = _nice_step(span / max(1, cols / 10))
    chars = [" "] * (cols + 8)
    free_from = 0
    for k in range(int(span / step) + 1):
        t = k * step
        pos = round(t * per_unit)
        text = f"{t:g}"
        if pos >= free_from and pos + len(text) <= len(chars):
            chars[pos:pos + len(text)] = list(text)
            free_from = pos + len(text) + 2
    return "".join(chars[:cols]).rstrip().ljust(cols)


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= raw."""
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
