"""benchmarks.vs_torch_tp: the rows from given per-rank samples (medians, ratios, CPU over the ranks, parameter bytes,
the two sides' loss gap) and the report's tables."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from benchmarks import vs_torch_tp


def _rank(ours: list[float], torch: list[float], cpu: float, loss: float) -> dict[str, Any]:
    sizes = {"ours": 10, "torch": 10, "expected": 10, "whole_model": 36}
    return {"1f1b sp=False": {"samples": {"ours": ours, "torch": torch},
                              "cpu": {"ours": [cpu] * len(ours), "torch": [2 * cpu] * len(ours)},
                              "param_bytes": sizes, "losses": {"ours": [loss] * len(ours),
                                                               "torch": [1.0] * len(ours)}}}


def test_rows_compare_medians_pair_the_steps_and_check_the_losses() -> None:
    cfg = vs_torch_tp.VsTorchTPConfig(schedules=("1f1b",), sequence_parallel=(False,))
    ranks = [_rank([2.0, 4.0, 6.0], [1.0, 4.0, 3.0], 0.010, 1.0)] * 3 + [_rank([2.0, 4.0, 6.0], [1.0, 4.0, 3.0],
                                                                               0.010, 1.5)]
    (row,) = vs_torch_tp.summarize(cfg, ranks)
    assert row["ratio"] == pytest.approx(4.0 / 3.0) and row["paired_ratio"]["median_s"] == pytest.approx(2.0)
    assert row["cpu_ms"] == {"ours": pytest.approx(40.0), "torch": pytest.approx(80.0)}
    assert row["loss_gap"] == pytest.approx(0.5)  # read on the last rank (a last stage on both sides)
    assert row["schedule"] == "1f1b" and not row["sequence_parallel"] and row["torch_class"] == "Schedule1F1B"
    assert len(row["param_bytes"]) == 4
    blocks = vs_torch_tp.report({"rows": [row], "config": asdict(cfg)})
    tables = [b for b in blocks if isinstance(b, list)]
    assert [len(t) for t in tables] == [2, 5] and all(len(set(map(len, t))) == 1 for t in tables)


def test_the_full_run_compares_1f1b_and_a_zero_bubble_schedule_with_and_without_sp() -> None:
    cfg = vs_torch_tp.VsTorchTPConfig()
    assert cfg.schedules == ("1f1b", "zbv") and cfg.sequence_parallel == (False, True) and cfg.target == 1.0
    assert vs_torch_tp.PP * vs_torch_tp.TP == 4
