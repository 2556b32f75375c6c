"""benchmarks.memory_vs_predicted: the quick run (2 ranks; measured activations equal the byte model's) and the
report's verdicts from given bytes."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks import memory_vs_predicted as bench
from benchmarks.framework import render


@pytest.fixture(scope="module")
def quick() -> dict:
    return bench.run(bench.QUICK)


def test_the_quick_run_measures_every_rank_against_the_model(quick: dict) -> None:
    assert set(quick["rows"]) == set(bench.QUICK.schedules)
    for name, ranks in quick["rows"].items():
        assert len(ranks) == bench.QUICK.ranks
        for r in ranks:
            measured, predicted = r["measured"], r["predicted"]
            assert measured["activations_peak"] == predicted["activations"] > 0, name  # the same bytes, counted alike
            assert measured["total_peak"] >= measured["activations_peak"] + measured["params_peak"]
            assert predicted["peak"] >= predicted["activations"] + predicted["params"]
    text = render(bench.report(quick), markdown=False)
    assert "1F1B: the first rank's measured activation peak is" in text


def _row(total: float, acts: float, predicted_total: float, predicted_acts: float) -> dict:
    return {"measured": {"total_peak": total, "activations_peak": acts, "messages_peak": 0},
            "predicted": {"peak": predicted_total, "activations": predicted_acts, "messages": 0}}


def test_the_report_takes_the_worst_rank_of_either_kind() -> None:
    cfg = bench.MemoryBenchConfig(schedules=("1f1b", "zbv"), ranks=2)
    rows = {"1f1b": [_row(105, 40, 100, 40), _row(100, 10, 100, 10)],
            "zbv": [_row(100, 50, 100, 50), _row(88, 20, 100, 20)]}
    assert bench.errors(rows["zbv"]) == {"total": pytest.approx(0.12), "activations": 0.0}
    text = render(bench.report({"config": asdict(cfg), "rows": rows}), markdown=False)
    assert "5.00%" in text and "12.00%" in text
    assert "on every rank (total peak and activations): missed." in text
    assert "first rank's measured activation peak is 4.00x the last's" in text


def test_the_report_gives_each_levers_worst_error_beside_the_plain_verdict() -> None:
    cfg = bench.MemoryBenchConfig(schedules=("1f1b",), ranks=2, checkpointing=(False,))
    assert bench.cases(cfg) == ["1f1b", "1f1b selective", "1f1b offload"]
    rows = {"1f1b": [_row(100, 40, 100, 40), _row(100, 10, 100, 10)],
            "1f1b selective": [_row(60, 20, 100, 40), _row(100, 10, 100, 10)],
            "1f1b offload": [_row(100, 30, 100, 25), _row(100, 10, 100, 10)]}
    text = render(bench.report({"config": asdict(cfg), "rows": rows}), markdown=False)
    assert "on every rank (total peak and activations): met." in text
    assert "With selective checkpointing the worst error is 50%: the model holds what" in text
    assert "With offload (True) the worst error is 20%: the model moves" in text
