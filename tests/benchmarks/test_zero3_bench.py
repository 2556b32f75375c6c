"""benchmarks.zero3_bench: the quick run completes, its collectives equal the residency episodes, its report."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import zero3_bench as bench
from benchmarks.framework import render


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return bench.run(bench.QUICK)


def test_the_quick_run_counts_the_episodes(result: dict[str, Any]) -> None:
    rows = {r["label"]: r for r in result["rows"]}
    assert set(rows) == {label for label, _, _ in bench.VARIANTS}
    for label in ("ZeRO-3, window all", "ZeRO-3, window 1"):
        assert rows[label]["matches"] is True, rows[label]
        assert rows[label]["gathers"] == rows[label]["episodes"], rows[label]
    every = rows["ZeRO-3, window all"]
    assert every["gathers"] == every["scatters"] == 4  # ZBV at PP=2: one per stage per step, 4 stages a replica
    assert rows["ZeRO-3, window 1"]["episodes"] > every["episodes"]  # two stages per rank, one resident at once
    # at DP=2 with two stages per rank windowed gradients would hold as much: reduced once per step by default
    assert rows["ZeRO-3, window 1"]["scatters"] == every["scatters"]
    one, two = rows["ZeRO-3, window 1"], rows["ZeRO-2"]
    assert one["params_peak"] < two["params_peak"] and one["params_sharded"] == two["params_sharded"] > 0, one
    assert all("ratio" in r for r in rows.values())  # timed; no timing is asserted


def test_the_report_is_one_table_of_the_runs(result: dict[str, Any]) -> None:
    tables = [b for b in bench.report(result) if isinstance(b, list)]
    assert [len(t) for t in tables] == [1 + len(bench.VARIANTS)] and len(set(map(len, tables[0]))) == 1
    assert "ZeRO-3, window 1" in render(bench.report(result), markdown=True)


def test_a_count_off_the_episodes_is_not_a_match() -> None:
    rank = {"gathers": {"0": 4, "3": 6}, "scatters": {"0": 2, "3": 2}, "episodes": {"0": 2, "3": 3},
            "reductions": {"0": 1, "3": 1}}
    assert bench.matches_episodes([rank], 2)
    assert not bench.matches_episodes([{**rank, "gathers": {"0": 4, "3": 4}}], 2)
    assert not bench.matches_episodes([{**rank, "scatters": {"0": 4, "3": 2}}], 2)
    assert not bench.matches_episodes([{**rank, "gathers": None}], 2)
    windowed = {**rank, "scatters": {"0": 2, "3": 4}, "reductions": {"0": 1, "3": 2}}  # one per episode with grads
    assert bench.matches_episodes([windowed], 2)
    assert not bench.matches_episodes([{**windowed, "scatters": {"0": 2, "3": 2}}], 2)
