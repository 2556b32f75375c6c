"""benchmarks.dp_compression: rows, table, verdict and figures from given runs; the config's refusals."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks import dp_compression as bench

CFG = bench.DPBenchConfig(steps=30, tail=5)


def _run(label: str, optimizer: str, compression: str, wire: float, loss: float, step_s: float,
         compute_s: float, fewer: float | None = None, within: float | None = None) -> dict[str, Any]:
    return {"label": label, "optimizer": optimizer, "compression": compression, "losses": [loss] * CFG.steps,
            "wire": [wire] * CFG.steps, "step_s": [step_s] * CFG.steps, "compute_s": [compute_s] * CFG.steps,
            "fewer_bytes_target": fewer, "loss_target": within}


RUNS = [
    _run("fp32 all-reduce", "adamw", "None", 400e3, 2.0, 0.100, 0.001),
    _run("int8", "adamw", "Int8Options()", 100e3, 2.01, 0.120, 0.006, fewer=3.8, within=0.01),
    _run("fp32 all-reduce", "sgd", "None", 400e3, 2.5, 0.090, 0.001),
    _run("DGC 99%", "sgd0", "DGCOptions()", 8e3, 2.6, 0.110, 0.011, fewer=45, within=0.015),
]


def test_rows_compare_each_method_with_the_fp32_run_of_its_optimizer() -> None:
    rows = {r["label"]: r for r in bench.summarize(RUNS, CFG)}
    int8, dgc = rows["int8"], rows["DGC 99%"]
    assert int8["fewer_steady"] == pytest.approx(4.0) and int8["loss_rel"] == pytest.approx(0.005)
    assert int8["met"] is True
    assert dgc["fewer_steady"] == pytest.approx(50.0) and dgc["loss_rel"] == pytest.approx(0.04)  # vs SGD
    assert dgc["met"] is False  # 4% worse than SGD with momentum: outside 1.5%
    # break-even: bytes saved per step / extra compute per step
    assert int8["break_even_Bps"] == pytest.approx(300e3 / 0.005)
    assert dgc["break_even_Bps"] == pytest.approx(392e3 / 0.010)
    assert rows["fp32 all-reduce"]["break_even_Bps"] is None and rows["fp32 all-reduce"]["met"] is None


def test_the_report_holds_a_row_per_method_and_a_verdict_from_the_figures() -> None:
    rows = bench.summarize(RUNS, CFG)
    result = {"config": {**asdict(CFG), "methods": []}, "rows": rows, "runs": RUNS}
    intro, table, verdict = bench.report(result)
    assert isinstance(table, list) and len(table) == 1 + len(RUNS) and len(set(map(len, table))) == 1
    assert [r[8] for r in table[1:]] == ["-", "yes", "-", "**no**"]  # the "met" column
    assert isinstance(verdict, str) and all(r["label"] in verdict for r in rows if r.get("break_even_Bps"))
    assert f"{300e3 / 0.005 / 1e6:.0f}" in verdict and f"{392e3 / 0.010 / 1e6:.0f}" in verdict  # the span's ends
    assert bench._verdict(rows[:1]) == ""  # nothing compressed: no verdict


def test_figures_are_written(tmp_path: Path) -> None:
    made = bench.figures({"runs": RUNS, "rows": bench.summarize(RUNS, CFG)}, str(tmp_path))
    assert [name for name, _ in made] == ["dp_compression_loss.png", "dp_compression_bytes_vs_loss.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name, _ in made)


def test_too_few_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="steps must be >= tail"):
        bench.DPBenchConfig(steps=3)
    assert bench.QUICK.steps >= bench.QUICK.tail + 5
