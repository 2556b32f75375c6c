"""Smoke test of benchmarks/compression.py (2 gloo ranks, the small model, 2 reps); no timing asserts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import compression  # noqa: E402


@pytest.mark.timeout(240)
def test_quick_run_writes_rows_with_bytes_and_break_even(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    assert compression.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
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
    assert "| GPT example (4 x 64)" in capsys.readouterr().out


def test_bad_reps_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert compression.main(["--reps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "compression.py: --reps must be >= 1, got 0"
