"""Smoke test of examples/hf_llama.py: a tiny Hugging Face Llama trains with DualPipe and reports."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_example_trains_and_reports_loss_and_bubble(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_llama.py"), "--ranks", "2", "--microbatches", "4",
         "--steps", "3", "--batch-size", "8", "--block-size", "16"],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layers per part [[0, 1], [2, 3]]" in proc.stdout  # 4 layers over DualPipe's 2 parts
    found = re.search(r"dualpipe on 2 ranks, 4 microbatches: loss ([\d.]+) -> ([\d.]+) in 3 steps", proc.stdout)
    assert found is not None, proc.stdout
    assert 3.5 < float(found.group(1)) < 5.0  # about ln(73) at random init
    bubble = re.search(r"measured bubble ratio of the last step: ([\d.]+)% \(simulated with its measured "
                       r"per-stage costs: ([\d.]+)%\)", proc.stdout)
    assert bubble is not None, proc.stdout
    assert 0.0 < float(bubble.group(1)) < 100.0 and 0.0 < float(bubble.group(2)) < 100.0, proc.stdout
