"""Smoke test of examples/moe_dualpipe.py on a short run: it trains DualPipeV with expert parallelism on 4
processes and draws the measured timeline with the expert-parallel lane."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_moe_example_trains_and_draws_the_ep_lane(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "moe_dualpipe.py"), "--steps", "2", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PP=2 x DP=2 with ep=2: loss" in proc.stdout
    png = tmp_path / "moe_dualpipev_measured.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
