"""Tests for benchmarks/dp_compression.py: the summary, table, verdict and figures from given runs (the
training itself is what `make bench` measures), and the CLI's bad input."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import dp_compression as bench  # noqa: E402

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
    assert rows["fp32 all-reduce"]["break_even_Bps"] is None


def test_table_verdict_and_markdown_say_what_was_measured() -> None:
    rows = bench.summarize(RUNS, CFG)
    text = bench.table(rows, CFG)
    assert "| int8 | AdamW lr 0.003 |" in text and "**no**" in text and "| yes |" in text
    verdict = bench._verdict(rows)
    assert "2 of 2 compressed runs were slower than their fp32 run" in verdict
    assert "2 of 2 methods spend more CPU" in verdict
    assert "between 39 and 60 MB/s per rank" in verdict
    result = {"config": {**bench.asdict(CFG), "methods": []}, "rows": rows, "runs": RUNS, "loadavg": [1, 2, 3]}
    md = bench.markdown(result, [("img/x.png", "X")])
    assert text in md and verdict in md and "![X](img/x.png)" in md


def test_figures_are_written(tmp_path: Path) -> None:
    paths = bench.figures(RUNS, bench.summarize(RUNS, CFG), str(tmp_path))
    assert [Path(p).name for p in paths] == ["dp_compression_loss.png", "dp_compression_bytes_vs_loss.png"]
    assert all(Path(p).stat().st_size > 10_000 for p in paths)


def test_too_few_steps_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--steps", "3"]) == 2
    assert "--steps must be >= 25" in capsys.readouterr().err
