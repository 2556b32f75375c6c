"""benchmarks.auto_vs_hand: the summary from given samples, the models, a smoke run's figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import auto_vs_hand, runner


def test_summary_ranks_auto_among_the_hand_picked_schedules() -> None:
    measured = {"names": ["auto", "1f1b, M=4", "zbv, M=8"], "predicted_s": 0.100, "predicted": [0.1, 0.09, 0.2],
                "seconds": [[0.11, 0.12, 0.10], [0.10, 0.10, 0.10], [0.13, 0.14, 0.15]]}
    out = auto_vs_hand.summarize(measured)
    assert out["auto_s"] == pytest.approx(0.11) and out["error"] == pytest.approx(0.10)
    assert out["best_hand"] == "1f1b, M=4" and out["ratio"] == pytest.approx(1.10)
    assert out["rank"] == 2 and out["candidates"] == 3
    assert out["predicted_ok"] and not out["pick_ok"], "10% slower than 1F1B: the 5% target is missed"
    assert [r["candidate"] for r in out["rows"]] == measured["names"]
    assert not out["confirmed"] and out["sweep_ratio"] == out["ratio"]


def test_a_head_to_head_judges_the_pick_by_the_median_of_its_rounds_ratios() -> None:
    measured = {"names": ["auto", "1f1b, M=4", "zbv, M=8"], "predicted_s": 0.100, "predicted": [0.1, 0.09, 0.2],
                "seconds": [[0.11, 0.12, 0.10], [0.10, 0.10, 0.10], [0.13, 0.14, 0.15]],
                "confirm": {"rival": 1, "auto": [0.100, 0.200, 0.103], "hand": [0.100, 0.190, 0.100]}}
    out = auto_vs_hand.summarize(measured)
    assert out["sweep_ratio"] == pytest.approx(1.10) and out["ratio"] == pytest.approx(1.03)  # rounds 1.0, 1.053, 1.03
    assert out["confirmed"] and out["pick_ok"]
    model = {**measured, **out, "model": {"name": "m", "widths": [1], "classes": 2, "batch": 1}, "plan": "p",
             "overhead": None, "auto_build_s": 1.0, "auto_cached_build_s": 1.0, "source": "measured"}
    summary, _, per_candidate = auto_vs_hand.report({"models": [model]})
    assert len(summary) == 2 and summary[1][-1] == "yes" and len(per_candidate) == 1 + len(measured["names"])


def test_the_models_have_uneven_widths_and_a_heavy_head() -> None:
    for spec in auto_vs_hand.AutoBenchConfig().models:
        layers, head = auto_vs_hand.build_model(spec)
        assert len(set(spec.widths)) > 3 and len(layers) == len(spec.widths) - 1
        head_params = sum(p.numel() for p in head.parameters())
        assert head_params > max(sum(p.numel() for p in layer.parameters()) for layer in layers)
        x, y = auto_vs_hand.make_batch(spec)
        assert x.shape == (spec.batch, spec.widths[0]) and int(y.max()) < spec.classes


@pytest.mark.timeout(300)
def test_quick_run_writes_the_summary_and_its_docs_block(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nprose kept\n", encoding="utf-8")
    assert runner.main(["--quick", "--out", str(tmp_path), "--docs", str(docs)], only="auto_vs_hand") == 0
    part = json.loads((tmp_path / "results.json").read_text())["auto_vs_hand"]
    (model,) = part["models"]
    assert model["names"] == ["auto", "1f1b, M=4", "zb-h1, M=4"]
    assert all(len(s) == 2 for s in model["seconds"]) and model["predicted_s"] > 0
    assert len(model["confirm"]["auto"]) == len(model["confirm"]["hand"]) == 2 and model["confirmed"]
    assert re.match(r"\S+, M=\d+, ZeRO 0, gradient compression none \(predicted step [\d.]+ ms\)$", model["plan"])
    assert model["source"].startswith("cache "), "built twice: the run's auto Pipeline read the first one's cache"
    assert model["auto_build_s"] > 0 and model["auto_cached_build_s"] > 0
    text = (docs / "benchmarks.md").read_text()
    assert "prose kept" in text and "<!-- bench:auto-vs-hand:begin -->" in text
    assert model["rank"] <= model["candidates"] == 3 and model["error"] == pytest.approx(
        model["auto_s"] / model["predicted_s"] - 1)
