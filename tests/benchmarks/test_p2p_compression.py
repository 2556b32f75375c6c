"""benchmarks.p2p_compression's smoke run: bytes per SEND exactly, losses, docs block, --replot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import p2p_compression, runner


@pytest.mark.timeout(300)
def test_quick_run_measures_bytes_losses_and_writes_its_docs_block(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nprose kept\n", encoding="utf-8")
    argv = ["--out", str(tmp_path), "--docs", str(docs)]
    assert runner.main(["--quick", *argv], only="p2p_compression") == 0
    part = json.loads((tmp_path / "results.json").read_text())["p2p_compression"]
    cfg = p2p_compression.QUICK
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
        assert row["nonfinite_sends"] == 0 and all(math.isfinite(x) and x > 0 for x in row["losses"])
        assert abs(row["loss_rel"]) < 0.05  # 3 steps from the same weights
    assert rows["fp32"]["loss_rel"] == 0.0 and set(part["codec_s"]) == {"bf16", "fp8", "int8"}
    text = (docs / "benchmarks.md").read_text()
    assert text.startswith("# Benchmarks\n\nprose kept\n") and "<!-- bench:p2p:begin -->" in text
    assert "(img/p2p_loss.png)" in text and (docs / "img" / "p2p_loss.png").stat().st_size > 0
    (docs / "img" / "p2p_loss.png").unlink()
    assert runner.main(["--replot", *argv], only="p2p_compression") == 0  # no measuring
    assert (docs / "img" / "p2p_loss.png").exists() and (docs / "benchmarks.md").read_text() == text


def test_too_few_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="steps must be >= last"):
        p2p_compression.P2PConfig(steps=5)
