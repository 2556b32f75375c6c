"""benchmarks/compare_runs.py: the before/after table over several results.json files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import compare_runs  # noqa: E402


def _run(path: Path, ours: list[float], torch: list[float], ratio: float) -> str:
    row: dict[str, Any] = {"workload": "overhead-bound", "schedule": "1f1b", "ratio": ratio,
                           "samples": {"ours": ours, "torch": torch}}
    path.write_text(json.dumps({"vs_torch": [row]}))
    return str(path)


def test_the_table_gives_the_median_and_range_over_runs_and_the_pooled_paired_ratio(tmp_path: Path) -> None:
    before = [_run(tmp_path / "b1.json", [2.0, 2.0], [1.0, 1.0], 2.0)]
    after = [_run(tmp_path / "a1.json", [1.0, 3.0], [2.0, 3.0], 0.8),
             _run(tmp_path / "a2.json", [1.0], [1.0], 1.2),
             _run(tmp_path / "a3.json", [4.0], [2.0], 1.0)]
    lines = compare_runs.table(before, after)
    assert lines[2] == ("| overhead-bound | 1f1b | 2.00 (2.00-2.00, 1 runs); paired 2.00 (2.00-2.00) | "
                        "1.00 (0.80-1.20, 3 runs); paired 1.00 (0.62-1.75) |")


def test_a_missing_file_is_one_line_and_exit_code_2(tmp_path: Path, capsys: Any) -> None:
    missing = str(tmp_path / "nope.json")
    assert compare_runs.main(["--before", missing, "--after", missing]) == 2
    assert capsys.readouterr().err.startswith("compare_runs: ")
