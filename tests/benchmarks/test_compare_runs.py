"""benchmarks.compare_runs: the before/after table over several results.json files (and the older format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import compare_runs


def _run(path: Path, ours: list[float], torch: list[float], ratio: float) -> str:
    row: dict[str, Any] = {"workload": "overhead-bound", "schedule": "1f1b", "ratio": ratio,
                           "samples": {"ours": ours, "torch": torch}}
    path.write_text(json.dumps({"vs_torch": {"rows": [row], "meta": {}}}))
    return str(path)


def test_the_table_gives_the_median_and_range_over_runs_and_the_pooled_paired_ratio(tmp_path: Path) -> None:
    before = [_run(tmp_path / "b1.json", [2.0, 2.0], [1.0, 1.0], 2.0)]
    after = [_run(tmp_path / "a1.json", [1.0, 3.0], [2.0, 3.0], 0.8),
             _run(tmp_path / "a2.json", [1.0], [1.0], 1.2),
             _run(tmp_path / "a3.json", [4.0], [2.0], 1.0)]
    got = compare_runs.summarize(after)[("overhead-bound", "1f1b")]
    assert got["ratios"] == [0.8, 1.2, 1.0] and got["paired"] == [0.5, 1.0, 1.0, 2.0]
    assert compare_runs._quartiles(got["paired"]) == (0.625, 1.0, 1.75)
    lines = compare_runs.table(before, after)
    assert len(lines) == 3 and lines[2].startswith("| overhead-bound | 1f1b |") and lines[2].count("|") == 5


def test_a_missing_file_is_one_line_and_exit_code_2(tmp_path: Path, capsys: Any) -> None:
    missing = str(tmp_path / "nope.json")
    assert compare_runs.main(["--before", missing, "--after", missing]) == 2
    assert capsys.readouterr().err.startswith("compare_runs: ")


def test_results_of_the_older_format_are_read_too(tmp_path: Path) -> None:
    row = {"workload": "w", "schedule": "s", "ratio": 1.5, "samples": {"ours": [3.0], "torch": [2.0]}}
    (tmp_path / "old.json").write_text(json.dumps({"vs_torch": [row]}))
    assert compare_runs.summarize([str(tmp_path / "old.json")]) == {("w", "s"): {"ratios": [1.5], "paired": [1.5]}}
