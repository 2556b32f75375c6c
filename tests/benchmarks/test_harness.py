"""Smoke test of the benchmark harness on a tiny configuration (2 ranks, 2 timed steps); no timing asserts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness, models, report, run_all  # noqa: E402

STAT_KEYS = {"median_s", "q1_s", "q3_s", "n"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    assert run_all.main(["--quick", "--out", str(out), "--docs", "none"]) == 0
    with open(out / "results.json", encoding="utf-8") as fh:
        return json.load(fh), out


@pytest.mark.timeout(300)
def test_vs_torch_rows_have_every_field_and_matching_grads(quick_run: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick_run
    rows = results["vs_torch"]
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv"]
    for r in rows:
        assert STAT_KEYS <= set(r["ours"]) and STAT_KEYS <= set(r["torch"])
        assert r["ours"]["n"] == 2 and r["torch"]["n"] == 2
        assert r["ratio"] == pytest.approx(r["ours"]["median_s"] / r["torch"]["median_s"])
        assert r["grads_match"] == {"ours": True, "torch": True}, r["grad_error"]
        assert len(r["samples"]["ours"]) == len(r["samples"]["torch"]) == 2
        assert set(r["cpu_ms"]) == {"ours", "torch"} and all(v > 0 for v in r["cpu_ms"].values())


@pytest.mark.timeout(300)
def test_measured_vs_simulated_rows(quick_run: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick_run
    rows = results["measured_vs_simulated"]
    assert [r["schedule"] for r in rows] == ["1f1b", "dualpipe"]
    for r in rows:
        assert r["simulated_makespan_s"] > 0 and r["step"]["median_s"] > 0
        assert r["ratio"] == pytest.approx(r["step"]["median_s"] / r["simulated_makespan_s"])
        assert 0.0 <= r["bubble_measured"] < 1.0 and 0.0 <= r["bubble_simulated"] < 1.0
        ranks = {e[0] for e in r["measured_timeline"]["events"]}
        assert ranks == {0, 1}


@pytest.mark.timeout(300)
def test_overlap_and_tooling_rows(quick_run: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick_run
    (row,) = results["overlap"]
    assert row["speedup"] == pytest.approx(row["waited"]["median_s"] / row["async"]["median_s"])
    tooling = results["tooling"]
    assert tooling["rows"], "part 4 produced no rows"
    for r in [tooling["headline"], *tooling["rows"]]:
        assert {"schedule", "P", "M", "build_s", "lower_s", "verify_s", "simulate_s", "total_s"} <= set(r)
        assert r["total_s"] >= r["build_s"] > 0
    assert tooling["vs_torch"] and all(r["torch_get_schedule_ops_s"] > 0 for r in tooling["vs_torch"])


@pytest.mark.timeout(300)
def test_meta_table_and_figures(quick_run: tuple[dict[str, Any], Path]) -> None:
    results, out = quick_run
    meta = results["meta"]
    assert meta["quick"] is True and meta["world"] == 2 and meta["machine"]["cores"] >= 1
    text = report.stdout_report(results)
    for title in ("Runtime vs torch", "Measured vs simulated", "Communication overlap", "tooling"):
        assert title in text
    for name in ("bench_ratios.png", "bench_measured_vs_sim.png", "bench_tooling.png"):
        assert (out / name).stat().st_size > 1000


def test_update_doc_keeps_prose_outside_markers(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(f"# T\n\nprose before\n\n{report.BEGIN}\nold\n{report.END}\n\nprose after\n")
    report.update_doc(str(doc), "new table")
    text = doc.read_text()
    assert "old" not in text and "new table" in text
    assert text.index("prose before") < text.index("new table") < text.index("prose after")


def test_sleep_part_splits_input_and_weight_gradients() -> None:
    part = models.SleepPart(4, 0.0, 0.0, 0.0)
    x = torch.randn(3, 4, requires_grad=True)
    y = part(x)
    (dx,) = torch.autograd.grad(y, [x], torch.ones_like(y), retain_graph=True)
    assert part.bias.grad is None
    assert torch.equal(dx, torch.ones_like(x))
    (db,) = torch.autograd.grad(y, [part.bias], torch.ones_like(y))
    assert torch.equal(db, torch.full((4,), 3.0))


def test_summarize_quartiles_and_empty() -> None:
    stats = harness.summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert stats.median == 3.0 and stats.q1 < stats.median < stats.q3 and stats.n == 5
    with pytest.raises(ValueError, match="at least one sample"):
        harness.summarize([])


def test_reference_grads_mean_over_microbatches() -> None:
    spec = models.ModelSpec("mlp", num_layers=2, width=3, batch=4)
    parts = models.build_parts(spec, 2)
    x, y = models.make_batch(spec)
    grads, loss = models.reference_grads(parts, x, y, 2)
    whole = torch.nn.Sequential(*parts)
    pairs = zip(x.tensor_split(2), y.tensor_split(2), strict=True)
    expected = torch.stack([models.loss_fn(whole(a), b) for a, b in pairs]).mean()
    assert loss == pytest.approx(float(expected.detach()))
    expected.backward()
    first_weight = next(parts[0].parameters())
    assert first_weight.grad is not None and torch.allclose(grads[0][0], first_weight.grad)
    assert os.path.basename(run_all.__file__) == "run_all.py"
