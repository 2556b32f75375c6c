"""benchmarks.compile: paired ratios, the kept share with its interval, the verdicts and the report (no runs)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

import pytest

from benchmarks import compile as compile_bench
from benchmarks.framework import render

ROUNDS = 12


def _series(plain: float, onef: float, zb: float, zb_eager: float = 0.09,
            noise: float = 0.0) -> dict[str, list[float]]:
    """Rounds whose eager and compiled steps move together (a shared disturbance of `noise` per round)."""
    base = {"plain eager": 0.1, "plain compiled": plain, "1f1b eager": 0.1, "1f1b compiled": onef,
            "zb-h1 eager": zb_eager, "zb-h1 compiled": zb}
    load = [1.0 + noise * ((7 * r) % 5) for r in range(ROUNDS)]
    return {name: [t * f for f in load] for name, t in base.items()}


def test_paired_ratios_cancel_a_disturbance_that_falls_on_every_run_of_a_round() -> None:
    est = compile_bench.estimates(_series(0.08, 0.082, 0.07, noise=0.5))
    assert est["plain ratio"] == pytest.approx(0.8) and est["1f1b ratio"] == pytest.approx(0.82)
    assert est["1f1b kept"] == pytest.approx(0.9) and est["zb-h1 kept"] == pytest.approx((1 - 0.07 / 0.09) / 0.2)
    assert est["zb/1f1b eager"] == pytest.approx(0.9) and est["zb/1f1b compiled"] == pytest.approx(0.07 / 0.082)
    ci = compile_bench.intervals(_series(0.08, 0.082, 0.07, noise=0.5), draws=200)
    assert ci["1f1b kept"] == pytest.approx((0.9, 0.9))  # the disturbance cancels in every resample


def test_the_interval_widens_with_noise_that_is_not_shared_and_decides_only_outside_it() -> None:
    series = _series(0.08, 0.082, 0.07)
    series["1f1b compiled"] = [t * (1.0 + 0.2 * (r % 3 - 1)) for r, t in enumerate(series["1f1b compiled"])]
    v = compile_bench.verdicts(series)
    lo, hi = v["ci"]["1f1b kept"]
    assert lo < compile_bench.KEPT < hi and v["1f1b kept"][1] is False  # spans the target: not decided
    assert v["zb-h1 kept"] == (True, True) and v["zb wins eager"] == (True, True)


def test_the_report_judges_both_targets_and_says_when_there_is_no_gain() -> None:
    cfg = dataclasses.replace(compile_bench.CompileBenchConfig(models=("gpt",), designs=False, restarts=()),
                              rounds=ROUNDS)
    missed = {"config": asdict(cfg), "threads": [1, 1],
              "rounds_s": {"gpt": {"wall": _series(0.08, 0.09, 0.07), "cpu": _series(0.08, 0.082, 0.07)}}}
    text = render(compile_bench.report(missed), markdown=False)
    assert "1F1B missed" in text and "ZB-H1 met" in text and "(1, 1 torch threads)" in text
    assert "compiled still faster (0.78x): met" in text
    slower = {**missed, "rounds_s": {"gpt": {"wall": _series(0.08, 0.09, 0.1), "cpu": _series(0.08, 0.09, 0.1)}}}
    assert "compiled still faster (1.11x): missed" in render(compile_bench.report(slower), markdown=False)
    for plain_compiled in (0.11, 0.097):  # slower, or 3% faster: under MIN_SAVING
        none = {**missed, "rounds_s": {"gpt": {"wall": _series(plain_compiled, 0.09, 0.085),
                                               "cpu": _series(0.08, 0.082, 0.07)}}}
        assert "there is no gain to keep" in render(compile_bench.report(none), markdown=False)
    untested = {**missed, "rounds_s": {"gpt": {"wall": _series(0.08, 0.09, 0.085, zb_eager=0.11),
                                               "cpu": _series(0.08, 0.082, 0.07)}}}
    assert "is not put to the test" in render(compile_bench.report(untested), markdown=False)


def test_bad_shapes_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="microbatches 3"):
        compile_bench.check(dataclasses.replace(compile_bench.QUICK, microbatches=3))
    with pytest.raises(ValueError, match="unknown model"):
        compile_bench.check(dataclasses.replace(compile_bench.QUICK, models=("bert",)))


def test_the_quick_config_still_covers_every_design() -> None:
    compile_bench.check(compile_bench.QUICK)
    assert compile_bench.QUICK.designs and compile_bench.QUICK.restarts
    assert compile_bench.PART.name == "compile" and compile_bench.PART.in_bench
