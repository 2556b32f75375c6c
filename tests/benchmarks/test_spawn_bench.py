"""Tests for benchmarks/spawn_bench.py: the table from given times, one real probe, and the CLI's bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import spawn_bench as bench  # noqa: E402


def test_rows_give_the_median_and_range_of_each_launch() -> None:
    times = {"forkserver": [{"first_s": f, "second_s": s, "import_s": 1.0} for f, s in ((3.0, 1.0), (5.0, 0.9),
                                                                                      (4.0, 1.2))],
             "spawn": [{"first_s": 6.0, "second_s": 5.5, "import_s": 1.0}]}
    result = {"config": {"reps": 3, "ranks": 4}, "times": times, "load_before": [1.0], "load_after": [2.0]}
    rows = {r["method"]: r for r in bench.rows(result)}
    assert rows["forkserver"]["first_s"] == (4.0, 3.0, 5.0) and rows["forkserver"]["second_s"] == (1.0, 0.9, 1.2)
    md = bench.markdown(result)
    assert "| forkserver (default) | 4.00 (3.00-5.00) | 1.00 (0.90-1.20) |" in md
    assert "| spawn | 6.00 (6.00-6.00) | 5.50 (5.50-5.50) |" in md


@pytest.mark.timeout(120)
def test_a_probe_times_two_launches_in_a_fresh_interpreter() -> None:
    got = bench.probe("forkserver", 2)
    assert set(got) == {"import_s", "first_s", "second_s"} and all(v > 0 for v in got.values())


def test_bad_counts_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--reps", "0"]) == 2
    assert "--reps and --ranks must be >= 1" in capsys.readouterr().err
