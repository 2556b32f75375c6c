"""benchmarks.compile: the kept share of compile's saving, the verdicts and the report (no runs)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks import compile as compile_bench
from benchmarks.framework import render


def _medians(plain: float, onef: float, zb: float, zb_eager: float = 0.09) -> dict[str, float]:
    return {"plain eager": 0.1, "plain compiled": plain, "1f1b eager": 0.1, "1f1b compiled": onef,
            "zb-h1 eager": zb_eager, "zb-h1 compiled": zb}


def test_kept_is_the_pipelines_saving_over_the_plain_loops() -> None:
    v = compile_bench.verdicts(_medians(0.08, 0.082, 0.07))
    assert v["plain_saving"] == pytest.approx(0.2)
    assert v["kept"]["1f1b"] == pytest.approx(0.9) and v["kept"]["zb-h1"] == pytest.approx((1 - 0.07 / 0.09) / 0.2)
    assert v["zb_wins_eager"] and v["zb_wins_compiled"]


def test_the_report_judges_both_targets_and_says_when_there_is_no_gain() -> None:
    cfg = compile_bench.CompileBenchConfig(models=("gpt",), designs=False, restarts=False)
    missed = {"config": asdict(cfg), "medians_s": {"gpt": _medians(0.08, 0.09, 0.085)},
              "cpu_medians_s": {"gpt": _medians(0.08, 0.082, 0.07)}}
    text = render(compile_bench.report(missed), markdown=False)
    assert "1F1B missed" in text and "ZB-H1 met" not in text and "In CPU time the plain loop saves 20%" in text
    assert "ZB-H1 compiled faster than 1F1B compiled where it is eager (it is): met" in text
    for plain_compiled in (0.11, 0.097):  # slower, or 3% faster: under MIN_SAVING
        none = {**missed, "medians_s": {"gpt": _medians(plain_compiled, 0.09, 0.085)}}
        assert "there is no gain to keep" in render(compile_bench.report(none), markdown=False)


def test_the_quick_config_still_covers_every_design() -> None:
    assert compile_bench.QUICK.designs and compile_bench.QUICK.restarts
    assert compile_bench.PART.name == "compile" and compile_bench.PART.in_bench
