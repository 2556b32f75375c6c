"""benchmarks.plan_moe: the pairs' verdicts from given measurements (no run, no timing) and the report's tables."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks import harness, plan_moe

BASE = (1.0, 0.8, 1.3, 0.9, 1.1, 1.2, 0.95, 1.05)
"""The first candidate's step seconds per round: the others are multiples of it, round by round."""


def _row(name: str, predicted: float, times: tuple[float, ...]) -> dict[str, Any]:
    walls = [b * t for b, t in zip(BASE, times * (len(BASE) // len(times)), strict=True)]
    return {"candidate": name, "groups": [2, 2], "predicted_s": predicted, "others": {"cores": 0.2, "device": None},
            "measured": harness.summarize(walls).to_dict(), "walls_s": walls, "cpu_s": [0.1, 0.1]}


def test_pairs_tell_an_order_from_a_tie_and_from_noise() -> None:
    rows = [_row("a", 1.00, (1.0,)), _row("b", 1.01, (1.3,)), _row("c", 1.5, (1.05,))]
    found = {(p["faster"], p["slower"]): p["verdict"] for p in plan_moe.pairs(rows)}
    assert found == {("a", "b"): "within noise",  # predicted a tie, measured apart
                     ("a", "c"): "in order", ("b", "c"): "reversed"}
    assert plan_moe.verdict(plan_moe.pairs(rows)) == "reversed"
    assert plan_moe.verdict(plan_moe.pairs(rows[:1] + rows[2:])) == "holds"
    tie = [_row("a", 1.0, (1.0,)), _row("b", 1.0, (1.03, 0.98))]
    assert [p["verdict"] for p in plan_moe.pairs(tie)] == ["tie held"]
    noisy = [_row("a", 1.0, (1.0,)), _row("b", 1.2, (0.9, 1.08))]  # b faster in half the rounds
    assert plan_moe.verdict(plan_moe.pairs(noisy)) == "within noise"


def test_pairs_are_judged_round_by_round_not_by_overlapping_quartiles() -> None:
    a, b = _row("a", 1.0, (1.0,)), _row("b", 1.1, (1.04,))  # 4% slower in every round, quartiles overlapping
    assert b["measured"]["q1_s"] < a["measured"]["q3_s"]
    (pair,) = plan_moe.pairs([a, b])
    assert pair["apart"] and pair["verdict"] == "in order" and abs(pair["measured_gap"] - 0.04) < 1e-9


def test_report_and_the_schedules_of_plan_rows() -> None:
    rows = [_row("1f1b, M=4", 1.0, (1.0,)), _row("gpipe, M=4", 1.1, (1.2,))]
    part = {"rows": rows, "pairs": plan_moe.pairs(rows), "config": asdict(plan_moe.QUICK), "overhead": None,
            "notes": {"plan": "2 cores shared by the ranks, as calibrated"}, "calibration_walls": [["gpipe", 4, 0.5]]}
    blocks = plan_moe.report(part)
    assert [len(b) for b in blocks if isinstance(b, list)] == [3, 2]
    assert "holds" in str(blocks[-1]) and "gpipe M=4 500 ms" in str(blocks[-1])
    schedule = plan_moe._schedule("interleaved-1f1b(chunks=2)", 2, 4)
    assert schedule.num_groups == 4 and plan_moe._schedule("1f1b", 2, 4).num_groups == 2


def test_a_gap_inside_the_models_own_calibration_miss_is_a_predicted_tie() -> None:
    rows = [_row("a", 1.0, (1.0,)), _row("b", 1.05, (0.97, 1.02))]  # predicted 5% apart, measured a tie
    assert [p["verdict"] for p in plan_moe.pairs(rows)] == ["within noise"]
    assert [p["verdict"] for p in plan_moe.pairs(rows, tie=0.08)] == ["tie held"]
