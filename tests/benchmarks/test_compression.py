"""benchmarks.compression: its smoke run on 2 gloo ranks, bytes and break-even (no timing asserts)."""

from __future__ import annotations

import math

import pytest

from benchmarks import compression


@pytest.mark.timeout(240)
def test_quick_run_has_rows_with_bytes_and_break_even() -> None:
    rows = compression.run(compression.QUICK)["rows"]
    assert [r["method"] for r in rows] == [compression.METHODS[i][0] for i in (0, 3, 4)]
    numel = sum(math.prod(s) for s in compression.gpt_shapes(4, 64))
    base, int8, powersgd = rows
    assert all(r["numel"] == numel for r in rows)
    assert base["bytes"] == numel * 4  # fp32 all-reduce on 2 ranks: 2 (n-1)/n x 4 bytes per element
    assert base["break_even_Bps"] is None and base["ratio"] == 1.0
    assert 3.8 <= int8["ratio"] < 4.0 and powersgd["ratio"] > 6.0
    for r in (int8, powersgd):
        assert r["break_even_Bps"] is not None and r["break_even_Bps"] > 0
        assert r["compute_s"] > 0 and r["gloo_s"] > 0
    (table,) = compression.report({"rows": rows})
    assert len(table) == 4 and table[1][-1] == "-"


def test_bad_reps_are_refused() -> None:
    with pytest.raises(ValueError, match="reps must be >= 1"):
        compression.CompressionConfig(reps=0)
