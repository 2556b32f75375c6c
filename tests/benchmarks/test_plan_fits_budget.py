"""benchmarks.plan_fits_budget: the quick run (the limit binds every plan without a lever; the planner's plan is
measured) and the report's verdicts from given figures (timings are reported, never asserted)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks import plan_fits_budget as bench
from benchmarks.framework import render


@pytest.fixture(scope="module")
def quick() -> dict:
    return bench.run(bench.QUICK)


def test_the_quick_run_sets_a_limit_only_a_lever_meets(quick: dict) -> None:
    peaks = {tuple(plan): peak for plan, peak in quick["peaks"]}
    assert len(peaks) == len(bench.grid(bench.QUICK))
    plain = [p for (_, ckpt, stage, _), p in peaks.items() if not ckpt and stage == 0]
    assert quick["plain"] == min(plain) and quick["limit"] < min(plain)  # no plan without a lever fits
    assert [list(p) for p, v in peaks.items() if v <= quick["limit"]] == quick["fits"]
    assert len(quick["wall"]) == 1 + len(quick["fits"])  # the planner's pipeline, then every plan that fits
    assert all(len(w) == bench.QUICK.rounds for w in quick["wall"])
    assert quick["auto"]["peak"] > 0 and quick["auto"]["decided"]
    text = render(bench.report(quick), markdown=False)
    assert "The planner's plan fits (measured):" in text


def test_the_report_compares_with_the_fastest_plan_that_fits() -> None:
    cfg = bench.BudgetBenchConfig(schedules=("1f1b",), zero=((0, None), (1, None)))
    result = {"config": asdict(cfg), "limit": 100, "plain": 120,
              "peaks": [[["1f1b", False, 0, None], 120], [["1f1b", True, 0, None], 90], [["1f1b", True, 1, None], 80]],
              "fits": [["1f1b", True, 0, None], ["1f1b", True, 1, None]],
              "auto": {"plan": "1f1b, M=8, ZeRO 1", "peak": 95, "predicted": 97, "decided": "memory: ..."},
              "wall": [[1.0, 1.1], [1.0, 1.1], [0.9, 1.0]]}
    assert bench.ratios(result) == pytest.approx([1.0, (1 / 0.9 + 1.1) / 2])
    text = render(bench.report(result), markdown=False)
    assert "fits (measured): met" in text and "x checkpointing off/selective/full x ZeRO 0, 1, M=8" in text
    assert "1.11x the fastest manual plan that fits" in text and "1.05x: **missed**" not in text  # text: no emphasis
    assert "at most 1.05x: missed" in text
    over = dict(result, auto=dict(result["auto"], peak=101))
    assert "fits (measured): missed" in render(bench.report(over), markdown=False)
