"""benchmarks.schedule_tooling: the passes' timings of one case, and a CLI case in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import schedule_tooling as tooling
from benchmarks.runner import ROOT


def test_time_passes_reports_each_pass_and_their_total() -> None:
    row = tooling.time_passes("1f1b", 4, 8, 2)
    assert row["actions"] > 0 and row["repeats"] == 2
    parts = [row[k] for k in ("build_s", "lower_s", "verify_s", "simulate_s")]
    assert all(t > 0 for t in parts) and row["total_s"] >= max(parts)


@pytest.mark.timeout(120)
def test_a_cli_case_reports_its_exit_code_time_and_memory(tmp_path: Path) -> None:
    got = tooling.measure_cli(("simulate", "1f1b", "-p", "4", "-m", "8", "--json"), str(ROOT), str(tmp_path), 100)
    assert got["exit_code"] == 0 and got["wall_s"] > 0 and got["cpu_s"] > 0
    assert got["peak_rss_mb"] > 10
    result = {"source": str(ROOT), "cli": [{"name": "x", **got}]}
    text, table = tooling.report(result)
    assert len(table) == 2 and table[1][:2] == ["x", "0"] and tooling.figures(result, str(tmp_path)) == []
    assert set(tooling.CLI_CASES) >= {"simulate-1f1b-P10000", "compare-P64-M512-plot"}
