"""benchmarks.reliability: the summary and report from given per-rank times, and the config's refusals."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks import reliability as bench


def _result() -> dict:
    cfg = bench.ReliabilityConfig(steps=4)
    rank = {"wall": [[0.0105, 0.0102, 0.0110, 0.0101], [0.0100, 0.0100, 0.0104, 0.0101]],
            "cpu": [[0.02] * 4, [0.019] * 4], "fingerprint_s": 2e-5, "losses_equal": True,
            "save_s": [0.5, 0.4], "hash_all_s": [0.004, 0.006], "bytes": [2e6, 2e6],
            "check_wall": [3e-4, 1e-4, 2e-4], "check_cpu": [1e-4, 1e-4, 3e-4]}
    return {"config": asdict(cfg), "machine": {}, "ranks": [rank, {**rank, "fingerprint_s": 4e-5}]}


def test_summary_takes_medians_of_the_slowest_rank_and_the_paired_differences() -> None:
    s = bench.summary(_result())
    assert s["with_ms"] == pytest.approx(10.35) and s["without_ms"] == pytest.approx(10.05)
    assert s["diff_ms"] == pytest.approx(0.35)  # per-step differences 0.5, 0.2, 0.6, 0.0
    assert s["fingerprint_us"] == pytest.approx(30.0) and s["save_ms"] == pytest.approx(450.0)
    assert s["hash_ms"] == pytest.approx(5.0) and s["checkpoint_mb"] == pytest.approx(2.0) and s["same_losses"]
    assert s["check_wall_ms"] == pytest.approx(0.2) and s["check_cpu_ms"] == pytest.approx(0.1)


def test_report_has_both_tables() -> None:
    blocks = bench.report(_result())
    tables = [b for b in blocks if isinstance(b, list)]
    assert len(tables) == 2 and all(len(set(map(len, t))) == 1 for t in tables)
    assert tables[0][3][1] == "+0.35 (+0.05 to +0.57)" and "the same losses" in blocks[0]
    assert "The check alone is 2.0% of a step's wall time and 0.5% of its CPU time" in blocks[2]


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="ranks, steps and saves must be >= 1"):
        bench.ReliabilityConfig(steps=0)
