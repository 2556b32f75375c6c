"""benchmarks.plan_moe: the pairs' verdicts from given measurements (no run, no timing) and the report's tables."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks import plan_moe


def _row(name: str, predicted: float, median: float, q1: float, q3: float) -> dict[str, Any]:
    return {"candidate": name, "groups": [2, 2], "predicted_s": predicted, "others": {"cores": 0.2, "device": None},
            "measured": {"median_s": median, "q1_s": q1, "q3_s": q3, "n": 3}, "cpu_s": [0.1, 0.1]}


def test_pairs_tell_an_order_from_a_tie_and_from_noise() -> None:
    rows = [_row("a", 1.00, 1.0, 0.9, 1.1), _row("b", 1.01, 1.3, 1.2, 1.4), _row("c", 1.5, 1.05, 0.95, 1.15)]
    found = {(p["faster"], p["slower"]): p["verdict"] for p in plan_moe.pairs(rows)}
    assert found == {("a", "b"): "within noise",  # predicted a tie, measured apart
                     ("a", "c"): "in order", ("b", "c"): "reversed"}
    assert plan_moe.verdict(plan_moe.pairs(rows)) == "reversed"
    assert plan_moe.verdict(plan_moe.pairs(rows[:1] + rows[2:])) == "holds"
    tie = [_row("a", 1.0, 1.0, 0.9, 1.1), _row("b", 1.0, 1.05, 0.95, 1.15)]
    assert [p["verdict"] for p in plan_moe.pairs(tie)] == ["tie held"]
    noisy = [_row("a", 1.0, 1.1, 0.9, 1.2), _row("b", 1.2, 1.0, 0.95, 1.15)]
    assert plan_moe.verdict(plan_moe.pairs(noisy)) == "within noise"


def test_report_and_the_schedules_of_plan_rows() -> None:
    rows = [_row("1f1b, M=4", 1.0, 1.0, 0.9, 1.1), _row("gpipe, M=4", 1.1, 1.2, 1.15, 1.3)]
    part = {"rows": rows, "pairs": plan_moe.pairs(rows), "config": asdict(plan_moe.QUICK), "overhead": None,
            "notes": {"plan": "2 cores shared by the ranks, as calibrated"}, "calibration_walls": [["gpipe", 4, 0.5]]}
    blocks = plan_moe.report(part)
    assert [len(b) for b in blocks if isinstance(b, list)] == [3, 2]
    assert "holds" in str(blocks[-1]) and "gpipe M=4 500 ms" in str(blocks[-1])
    schedule = plan_moe._schedule("interleaved-1f1b(chunks=2)", 2, 4)
    assert schedule.num_groups == 4 and plan_moe._schedule("1f1b", 2, 4).num_groups == 2
