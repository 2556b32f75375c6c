"""Verify before running: unsound schedules fail on every rank before any transfer; verdicts are cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _train_helpers import adam, make_parts, mse

from duplexpipe.runtime import preflight
from duplexpipe.schedules.ir import Action, Op, Schedule, StageInfo, load_json, save_json
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def deadlocked() -> Schedule:
    """A lowered 2-rank schedule where each rank waits for the other: rank 0 sends its activation only
    after the backward that needs rank 1's gradient, which needs that activation."""
    rows = (
        (Action(0, Op.F, 0), Action(0, Op.RECV_B, 0), Action(0, Op.B, 0), Action(0, Op.SEND_F, 0)),
        (Action(1, Op.RECV_F, 0), Action(1, Op.F, 0), Action(1, Op.B, 0), Action(1, Op.SEND_B, 0)),
    )
    return Schedule("dead", 2, 1, (StageInfo(0, 0), StageInfo(1, 1)), rows)


def test_a_sound_schedule_passes_and_its_verdict_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = preflight.verify
    monkeypatch.setattr(preflight, "verify", lambda s, nccl: calls.append(s.name) or real(s, nccl=nccl))
    schedule = lower(build("zbv", 4, 8))
    fingerprint = schedule.fingerprint()
    before = preflight.cache_info().hits
    assert preflight.verdict(schedule, fingerprint, nccl=False) == ""
    assert preflight.verdict(lower(build("zbv", 4, 8)), fingerprint, nccl=False) == ""  # an equal copy
    assert calls.count("zbv") <= 1 and preflight.cache_info().hits >= before + 1  # verified once at most


def test_a_deadlocked_schedule_gets_the_verifiers_report() -> None:
    schedule = deadlocked()
    text = preflight.verdict(schedule, schedule.fingerprint(), nccl=False)
    assert "deadlock in 'dead'" in text and "cycle:" in text
    assert preflight.verdict(schedule, schedule.fingerprint(), nccl=True) == text


def run_dead_pipeline(path: str) -> dict[str, Any]:
    """One rank: build a Pipeline over the deadlocked schedule (the issue's scenario)."""
    from duplexpipe.train.pipeline_config import SafetyConfig
    from duplexpipe.train.trainer import Pipeline, PipelineConfig

    start = time.monotonic()
    try:
        Pipeline(make_parts(2), mse, adam, PipelineConfig(schedule=load_json(path),
                                                          safety=SafetyConfig(timeout_s=60.0)))
        out: dict[str, Any] = {"type": "built"}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"type": type(exc).__name__, "text": str(exc)}
    out["seconds"] = time.monotonic() - start
    return out


_SCRIPT = """
import json, sys
sys.path[:0] = [{here!r}, {tests!r}]
from duplexpipe.launch.processes import launch
import test_preflight
if __name__ == "__main__":
    print(json.dumps(launch(test_preflight.run_dead_pipeline, 2, ({path!r},), timeout_s=120)))
"""


@pytest.mark.timeout(180)
def test_a_deadlocked_schedule_fails_on_every_rank_quickly_and_exits_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "dead.json"
    save_json(deadlocked(), str(path))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(here=HERE, tests=TESTS, path=str(path))],
                          capture_output=True, text=True, timeout=170, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    for rank, got in enumerate(ranks):
        assert got["type"] == "ScheduleError", (rank, got)
        assert "schedule 'dead' cannot run: deadlock in 'dead'" in got["text"], (rank, got)
        assert "cycle: rank 0: 0B0 -> 0SEND_F0 => rank 1: 1F0 -> 1B0 -> 1SEND_B0" in got["text"], (rank, got)
        assert got["seconds"] < 30.0, (rank, got)  # the runtime's timeout is 60 s
