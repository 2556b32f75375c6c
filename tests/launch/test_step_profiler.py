"""Tests for duplexpipe.launch.step_profiler: the chosen steps' trace is written, never through a planted link."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from duplexpipe.launch.step_profiler import StepProfiler


def test_the_trace_of_the_chosen_steps_replaces_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    profiler = StepProfiler("2:3", str(tmp_path), rank=1)
    profiler.path.parent.mkdir(parents=True)
    profiler.path.symlink_to(victim)
    written = []
    for step in (1, 2, 3, 4):
        profiler.before(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        written.append(profiler.after(step))
    assert written == [None, None, tmp_path / "profile" / "rank-1.json", None]
    assert victim.read_text() == "keep" and not profiler.path.is_symlink()
    events = json.loads(profiler.path.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    assert [p.name for p in profiler.path.parent.iterdir()] == ["rank-1.json"], "no temporary file left"
