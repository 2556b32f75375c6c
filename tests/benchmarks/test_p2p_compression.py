"""Smoke test of benchmarks/p2p_compression.py (DualPipe on 2 gloo ranks, 3 steps); no timing asserts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import p2p_compression  # noqa: E402


@pytest.mark.timeout(300)
def test_quick_run_measures_bytes_losses_and_writes_its_docs_section(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nprose kept\n", encoding="utf-8")
    assert p2p_compression.main(["--quick", "--out", str(tmp_path), "--docs", str(docs)]) == 0
    part = json.loads((tmp_path / "p2p.json").read_text())
    cfg = p2p_compression.quick_config()
    rows = {r["variant"]: r for r in part["rows"]}
    assert list(rows) == ["fp32", "bf16", "fp8", "int8"]
    # one message: (batch / microbatches) sequences x 64 characters x d_model, float32 when uncompressed
    seqs, d = cfg.batch_size // cfg.microbatches, cfg.d_model
    numel = seqs * 64 * d
    want = {"fp32": 4 * numel, "bf16": 2 * numel, "fp8": numel + 4 * seqs * 64, "int8": numel + 4 * -(-numel // 256)}
    for label, row in rows.items():
        assert row["bytes_per_send"] == want[label], (label, row["bytes_per_send"])
        assert row["bytes_ratio"] == pytest.approx(want[label] / want["fp32"])
        assert row["sends"] > 0 and row["sends"] == rows["fp32"]["sends"]
        assert len(row["losses"]) == cfg.steps and row["step"]["n"] == cfg.steps
        assert row["nonfinite_sends"] == 0
        assert abs(row["loss_rel"]) < 0.05  # 3 steps from the same weights
    assert rows["fp32"]["loss_rel"] == 0.0 and set(part["codec_s"]) == {"bf16", "fp8", "int8"}
    text = (docs / "benchmarks.md").read_text()
    assert text.startswith("# Benchmarks\n\nprose kept\n") and p2p_compression.BEGIN in text
    assert "| dualpipe, int8 |" in text and (docs / "img" / "p2p_loss.png").stat().st_size > 0
    assert "dualpipe, fp8" in capsys.readouterr().out
    (docs / "img" / "p2p_loss.png").unlink()
    assert p2p_compression.main(["--replot", "--out", str(tmp_path), "--docs", str(docs)]) == 0  # no measuring
    assert (docs / "img" / "p2p_loss.png").exists() and (docs / "benchmarks.md").read_text() == text


def test_too_few_steps_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert p2p_compression.main(["--steps", "5"]) == 2
    assert capsys.readouterr().err.strip() == "p2p_compression.py: --steps must be >= 20, got 5"
