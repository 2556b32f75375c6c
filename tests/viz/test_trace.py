"""Tests of the Chrome trace: it loads, names one process per rank, one complete event per compute action."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _viz_cases import as_measured, hand_timeline, schedule_names, simulated

from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.timeline import Span, Timeline
from duplexpipe.viz.trace import COST_UNIT_US, chrome_trace, to_chrome_trace


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def check_events(data: dict[str, Any], timeline: Timeline, us_per_unit: float) -> None:
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.events)
    expected = sorted(
        (e.rank, round((e.start - timeline.start) * us_per_unit, 3), round(e.duration * us_per_unit, 3),
         e.action.stage, e.action.microbatch)
        for e in timeline.events
    )
    got = sorted((e["pid"], e["ts"], e["dur"], e["args"]["stage"], e["args"]["microbatch"]) for e in complete)
    assert got == expected
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(timeline.num_ranks)}


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_traces(name: str, tmp_path: Path) -> None:
    schedule, timeline = simulated(name)
    path = tmp_path / "t.json"
    to_chrome_trace(timeline, path)
    data = load(path)
    check_events(data, timeline, COST_UNIT_US)
    compute = sum(1 for _, _, a in schedule.iter_actions() if a.op.is_compute)
    assert sum(e["ph"] == "X" for e in data["traceEvents"]) == compute
    assert data["otherData"]["schedule"] == name and data["otherData"]["us_per_unit"] == COST_UNIT_US


def test_measured_seconds_become_microseconds(tmp_path: Path) -> None:
    _, sim = simulated("zb-h1")
    measured = as_measured(sim, 0.0025, origin=812.25)
    path = tmp_path / "m.json"
    to_chrome_trace(measured, path)
    data = load(path)
    check_events(data, measured, 1e6)
    first = min(e["ts"] for e in data["traceEvents"] if e["ph"] == "X")
    assert first == 0 and data["otherData"]["origin"] == pytest.approx(812.25)


def test_pair_args_name_both_parts_and_override_scale() -> None:
    timeline = hand_timeline([[("0F0", 0, 1), ("(0F1;1B0)OVERLAP_F_B", 1, 4), ("0W0", 4, 5)]])
    data = chrome_trace(timeline, us_per_unit=10)
    pair = next(e for e in data["traceEvents"] if e.get("cat") == "F&B")
    assert pair["name"] == "0F1&1B0" and pair["ts"] == 10 and pair["dur"] == 30
    assert pair["args"]["op"] == Op.OVERLAP_F_B.value
    assert (pair["args"]["stage"], pair["args"]["microbatch"]) == (0, 1)
    assert (pair["args"]["backward_stage"], pair["args"]["backward_microbatch"]) == (1, 0)
    with pytest.raises(ValueError, match="us_per_unit"):
        chrome_trace(timeline, us_per_unit=0)
    with pytest.raises(ValueError, match="Timeline"):
        chrome_trace({"events": []})  # type: ignore[arg-type]


def test_extra_lanes_become_threads_of_each_rank() -> None:
    base = hand_timeline([[("0F0", 0.0, 1.0), ("0B0", 2.0, 4.0)], [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0)]])
    spans = (Span(1, "dp", "bucket 0", 3.0, 5.0), Span(0, "dp", "bucket 1", 4.0, 4.5), Span(0, "dp", "wait", 4.2, 4.5))
    data = chrome_trace(replace(base, spans=spans), us_per_unit=10.0)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {(0, 0): "compute", (1, 0): "compute", (0, 1): "dp", (1, 1): "dp"}
    lane = sorted((e["pid"], e["name"], e["ts"], e["dur"]) for e in data["traceEvents"]
                  if e["ph"] == "X" and e["tid"] == 1)
    assert lane == [(0, "bucket 1", 40.0, 5.0), (0, "wait", 42.0, 3.0), (1, "bucket 0", 30.0, 20.0)]
    assert sum(e["ph"] == "X" and e["tid"] == 0 for e in data["traceEvents"]) == len(base.events)
