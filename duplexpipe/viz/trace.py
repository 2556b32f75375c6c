"""Chrome trace event JSON of a timeline (opens in Perfetto and chrome://tracing): one process per rank."""

from __future__ import annotations

import json
import os
from typing import Any

from duplexpipe.schedules.ir import Op, format_action
from duplexpipe.schedules.timeline import Timeline
from duplexpipe.viz import _style as st

US_PER_UNIT = {"s": 1e6, "sec": 1e6, "secs": 1e6, "second": 1e6, "seconds": 1e6,
               "ms": 1e3, "us": 1.0, "\u00b5s": 1.0, "ns": 1e-3}
"""Microseconds per timeline unit for the units with a meaning in wall time."""
COST_UNIT_US = 1000.0
"""Microseconds drawn for one unit of any other unit (simulated cost units): 1 unit shows as 1 ms."""


def us_per_unit_of(timeline: Timeline) -> float:
    """How many trace microseconds one unit of `timeline` becomes."""
    return US_PER_UNIT.get(timeline.unit.strip().lower(), COST_UNIT_US)


def chrome_trace(timeline: Timeline, *, us_per_unit: float | None = None) -> dict[str, Any]:
    """The trace as a dict: metadata naming each rank's process, then one "X" event per compute action
    (thread "compute") and per span of an extra lane (one thread per lane, e.g. "dp").

    Times are relative to the timeline's first start. `us_per_unit` overrides the unit conversion.
    """
    if not isinstance(timeline, Timeline):
        raise ValueError(f"chrome_trace needs a Timeline, got {type(timeline).__name__}")  # noqa: TRY004
    scale = us_per_unit_of(timeline) if us_per_unit is None else us_per_unit
    if not scale > 0:
        raise ValueError(f"us_per_unit must be > 0, got {us_per_unit}")
    events: list[dict[str, Any]] = []
    for r in range(timeline.num_ranks):
        events += [
            {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}},
            {"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}},
            {"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}},
        ]
    lanes = timeline.lanes()
    for r in range(timeline.num_ranks):  # extra lanes (e.g. "dp") as further threads of each rank
        events += [{"name": "thread_name", "ph": "M", "pid": r, "tid": 1 + i, "args": {"name": lane}}
                   for i, lane in enumerate(lanes)]
    origin = timeline.start
    for s in sorted(timeline.spans, key=lambda s: (s.rank, s.start, s.end)):
        events.append({"name": s.name, "cat": s.lane, "ph": "X", "pid": s.rank, "tid": 1 + lanes.index(s.lane),
                       "ts": round((s.start - origin) * scale, 3), "dur": round((s.end - s.start) * scale, 3),
                       "args": {"lane": s.lane}})
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start, e.end)):
        events.append({
            "name": st.short_token(e.action), "cat": st.kind_of(e.action), "ph": "X",
            "pid": e.rank, "tid": 0,
            "ts": round((e.start - origin) * scale, 3), "dur": round(e.duration * scale, 3),
            "args": _args(e.action),
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": timeline.schedule_name, "ranks": timeline.num_ranks,
                      "microbatches": timeline.num_microbatches, "source": timeline.source,
                      "unit": timeline.unit, "us_per_unit": scale, "origin": origin,
                      "bubble_ratio": timeline.bubble_ratio},
    }


def _args(action: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"stage": action.stage, "microbatch": action.microbatch,
                            "op": action.op.value, "action": format_action(action)}
    if action.op is Op.OVERLAP_F_B:
        backward = action.parts[1]
        args.update(backward_stage=backward.stage, backward_microbatch=backward.microbatch,
                    backward_op=backward.op.value)
    return args


def to_chrome_trace(timeline: Timeline, path: str | os.PathLike[str], *, us_per_unit: float | None = None) -> None:
    """Write `chrome_trace(timeline)` as JSON to `path`.

    Measured timelines in seconds keep their wall time; simulated cost units become 1 ms each
    (see `us_per_unit_of`), recorded under "otherData".
    """
    data = chrome_trace(timeline, us_per_unit=us_per_unit)
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        json.dump(data, fh, separators=(",", ":"))
        fh.write("\n")
