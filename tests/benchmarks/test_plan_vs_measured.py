"""benchmarks.plan_vs_measured: a quick run on 2 gloo ranks (no timing asserts; the in-pipeline calibration charged
scripted CPU costs, so its fit is exact) and the order check."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import plan_vs_measured, runner

SCRIPTED = (1.3, 50e-6, 120e-6, 2e-3)
"""The CPU costs the quick run's in-pipeline calibration is charged (compute scale, per compute action, per SEND/RECV,
per step): its fit must give them back, whatever the machine's load."""


@pytest.mark.timeout(300)
def test_quick_run_predicts_the_measured_activation_peaks_and_writes_its_section(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nprose kept\n", encoding="utf-8")
    scripted = "scripted_cpu=" + ",".join(map(str, SCRIPTED))
    assert runner.main(["--quick", "--set", scripted, "--out", str(tmp_path), "--docs", str(docs)],
                       only="plan_vs_measured") == 0
    part = json.loads((tmp_path / "results.json").read_text())["plan_vs_measured"]
    cfg = plan_vs_measured.QUICK
    assert [r["candidate"] for r in part["rows"]] == [f"{name}, M={m}" for name, m in cfg.candidates]
    for row in part["rows"]:
        assert len(row["samples"]) == cfg.steps and len(row["measured_acts"]) == cfg.ranks
        # the profile and the runtime count with one rule; only the non-scaling position ids differ
        assert row["bytes_err_per_rank"] < 0.01, row
        assert row["peaks_stable"] and row["predicted_s"] > 0
    assert part["link"]["latency_s"] > 0 and part["counting"]["on_s"] > 0
    assert set(part["rows"][0]["variants"]) == set(plan_vs_measured.VARIANTS)
    calibration = part["calibration"]
    text = (docs / "benchmarks.md").read_text()
    assert min(calibration["overhead"][k] for k in ("action_s", "message_s", "step_s")) >= 0
    assert len(calibration["check"]) == 3 and all(c["predicted_s"] > 0 for c in calibration["check"])
    assert len(calibration["samples"]) == 3 * cfg.ranks  # every rank on every calibration run
    real = part["in_pipeline"]  # the new model's calibration: the real parts, on no candidate's (schedule, M)
    assert not set(cfg.calibration) & set(cfg.candidates)
    assert real["overhead"] is not None, real.get("error")  # the charged costs are separable: a failed fit fails
    fitted = tuple(real["overhead"][k] for k in ("compute_scale", "action_s", "message_s", "step_s"))
    assert fitted == pytest.approx(SCRIPTED, rel=1e-6)
    assert [c["run"] for c in real["check"]] == [f"{name}, M={m}" for name, m in cfg.calibration]
    assert len(real["samples"]) == len(cfg.calibration) * cfg.ranks
    assert all(s["compute"] > 0 for s in real["samples"])
    assert 0 < real["fitted_cores"] <= part["calibration"]["cores"]
    failed = dict(part, in_pipeline=dict(real, overhead=None, error="cannot separate ..."))
    assert "FAILED, the previous model's terms used instead: cannot separate" in plan_vs_measured._model_note(failed)
    assert "prose kept" in text and "<!-- bench:plan-vs-measured:begin -->" in text
    assert (docs / "img" / plan_vs_measured.FIGURE).stat().st_size > 0
    tables = [b for b in plan_vs_measured.report(part) if isinstance(b, list)]
    assert [len(t) for t in tables] == [1 + len(part["rows"]), 1 + len(part["order"]),
                                        1 + len(calibration["check"]) + len(real["check"]), 1 + len(part["rows"])]
    assert re.search(r"alpha = [\d.]+", plan_vs_measured._model_note(part))


def test_the_calibration_may_not_run_a_candidate() -> None:
    with pytest.raises(ValueError, match=r"calibration runs \[\('1f1b', 8\)\] are candidates too"):
        plan_vs_measured.PvMConfig(calibration=(("gpipe", 4), ("1f1b", 8)))
    with pytest.raises(ValueError, match="scripted_cpu takes 4 costs"):
        plan_vs_measured.PvMConfig(scripted_cpu=(1.0, 2.0))


def _row(name: str, predicted: float, measured: float) -> dict[str, Any]:
    return {"candidate": name, "predicted_s": predicted, "measured": {"median_s": measured}}


def test_only_pairs_predicted_far_apart_are_checked_for_order() -> None:
    rows = [_row("a", 1.0, 2.0), _row("b", 1.1, 1.0), _row("c", 1.5, 3.0)]
    pairs = {(p["faster"], p["slower"]): p for p in plan_vs_measured.order_pairs(rows)}
    assert set(pairs) == {("a", "c"), ("b", "c")}, "a and b are predicted 10% apart: not checked"
    assert pairs[("a", "c")]["same_order"] and pairs[("b", "c")]["same_order"]
    assert pairs[("a", "c")]["predicted_gap"] == pytest.approx(0.5)
    swapped = plan_vs_measured.order_pairs([_row("a", 1.0, 2.0), _row("c", 1.5, 1.9)])
    assert [p["same_order"] for p in swapped] == [False]
