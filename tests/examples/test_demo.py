"""Smoke test of `make demo`'s script on a short run: it trains, draws every file and reports bubble ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_demo_trains_and_writes_every_output(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--ranks", "2", "--microbatches", "4",
         "--steps", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured: makespan" in proc.stdout and "simulated with the measured per-stage costs" in proc.stdout
    for name in ("loss.png", "measured_gantt.png", "measured_vs_simulated.png", "compare.png"):
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 20_000, name  # a drawn figure, not an empty canvas
    trace = json.loads((out / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    timeline = json.loads((out / "timeline.json").read_text())
    spans = timeline.get("spans", [])  # beside the actions: the stage links' exposed receive waits
    assert {lane for _, lane, *_ in spans} <= {"exposed"}
    assert len(events) == len(timeline["events"]) + len(spans) and timeline["events"]
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses["losses"]) == 4
