"""`duplexpipe train --schedule auto` with the default settings otherwise: it plans (profile, calibration, planner),
prints the plan and trains it (2 ranks, a small GPT; the calibration cached where conftest points DUPLEXPIPE_CACHE)."""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import pytest

from duplexpipe.cli.train_cmd import add_train_arguments, train_main
from duplexpipe.planner.calibration_cache import CACHE_ENV

SMALL = ["--task-option", "n_layer=2", "--task-option", "d_model=16", "--task-option", "n_head=2",
         "--task-option", "block_size=16"]


@pytest.mark.timeout(300)
def test_train_with_schedule_auto_plans_prints_and_trains() -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    # 8 samples over 4 microbatches: the old sample (one microbatch, 2 rows) could not be split into 4
    args = parser.parse_args(["--schedule", "auto", "--ranks", "2", "--steps", "2", "--microbatches", "4",
                              "--batch-size", "8", "--log-every", "0", *SMALL])
    out = io.StringIO()
    assert train_main(args, out) == 0
    text = out.getvalue()
    chosen = next(line for line in text.splitlines() if line.startswith("schedule='auto' chose "))
    assert ", M=4, ZeRO 0, gradient compression none (predicted step " in chosen, "--microbatches fixes M"
    cached = Path(chosen.split("measurements: measured, cached in ")[1].split(";")[0])
    assert cached.is_file() and Path(os.environ[CACHE_ENV]) in cached.parents, "conftest's cache, not ~/.cache"
    assert any(line.split()[:4] == ["schedule", "M", "ZeRO", "compression"] for line in text.splitlines())
    picked = chosen.split(" chose ")[1].split(",")[0]
    summary = f"auto (chose {picked}) on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps: loss "
    assert summary in text, text
