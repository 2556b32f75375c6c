"""benchmarks.checkpointing: the quick run (recompute counts: one per microbatch under ZB-H1, torch's checkpoint one
per engine call) and the report from given rounds (timings are reported, never asserted)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks import checkpointing as bench
from benchmarks.framework import render


@pytest.fixture(scope="module")
def quick() -> dict:
    return bench.run(bench.QUICK)


def test_the_quick_run_counts_one_recompute_per_microbatch(quick: dict) -> None:
    assert set(quick["rounds_s"]) == set(bench._names(bench.QUICK))
    assert all(len(t) == bench.QUICK.rounds for t in quick["rounds_s"].values())
    for schedule in bench.QUICK.schedules:
        assert bench.runs_per_microbatch(quick, f"{schedule} plain") == 1
        assert bench.runs_per_microbatch(quick, f"{schedule} checkpointed") == 2
    assert bench.runs_per_microbatch(quick, bench.TORCH) > 2  # torch's: once more per W engine call
    text = render(bench.report(quick), markdown=False)
    assert "ZB-H1 with checkpointing is" in text and "torch's checkpoint" in text


def test_the_report_judges_both_targets() -> None:
    cfg = bench.CheckpointingBenchConfig(schedules=("1f1b", "zb-h1"), microbatches=2)
    rounds = {"1f1b plain": [1.0, 1.0], "1f1b checkpointed": [1.3, 1.3], "zb-h1 plain": [0.9, 0.9],
              "zb-h1 checkpointed": [1.2, 1.2]}
    calls = {name: {"layer0": 2 if "checkpointed" in name else 1} for name in rounds}
    text = render(bench.report({"config": asdict(cfg), "rounds_s": rounds, "calls": calls}), markdown=False)
    assert "0.92x 1F1B with checkpointing (target at most 1x: met)" in text
    assert "1.33x ZB-H1 without (target at most 1.4x: met)" in text
