"""The auto-search benchmark's arithmetic: costs per part, the bounds it prints, one case and its report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import auto_search  # noqa: E402
from benchmarks.auto_search import (  # noqa: E402
    GRID_PROFILES,
    LATENCY,
    UNIFORM,
    W_LIGHT,
    Profile,
    bounds,
    case,
    cost_for,
    v_bound,
)
from duplexpipe.schedules import registry  # noqa: E402
from duplexpipe.schedules.generators.auto import search_problem  # noqa: E402
from duplexpipe.schedules.generators.bounds import makespan_bound  # noqa: E402


def test_costs_follow_the_model_share_each_part_covers() -> None:
    heavy = Profile("x", 1.0, 2.0, 1.0, 0.25, heavy_last=1.5)
    linear = cost_for(registry.build("1f1b", 2, 4), heavy)
    assert dict(linear.stage_costs) == {0: (1.0, 2.0, 1.0), 1: (1.5, 3.0, 1.5)} and linear.latency == 0.25
    v = cost_for(registry.build("zbv", 2, 4), heavy)  # four half-size parts: 0, 1 | 2, 3 are the heavy share
    assert dict(v.stage_costs) == {0: (0.5, 1.0, 0.5), 1: (0.5, 1.0, 0.5), 2: (0.75, 1.5, 0.75),
                                   3: (0.75, 1.5, 0.75)}
    dual = cost_for(registry.build("dualpipe", 2, 4), heavy)  # two copies of two parts
    assert dict(dual.stage_costs)[3] == (1.5, 3.0, 1.5) and dict(dual.stage_costs)[2] == (1.0, 2.0, 1.0)


def test_bounds_reproduce_the_issue_and_the_two_sided_tail() -> None:
    assert bounds(8, 24, UNIFORM, 8)["lb"] == pytest.approx(79)
    got = bounds(8, 32, LATENCY, 8)
    assert (got["lb"], got["memory_aware"], got["two_sided"]) == pytest.approx((106.5, 110, 117))
    assert bounds(8, 32, LATENCY, 16)["two_sided"] == pytest.approx(106.5)  # enough memory: only LB remains
    w_light = bounds(8, 32, W_LIGHT, 8)  # RT = 8 + 7 x 2 = 22: head 22 - 8, tail 22 - 1 - 7 x 2.5
    assert (w_light["lb"], w_light["memory_aware"], w_light["two_sided"]) == pytest.approx((119, 126, 129.5))


@pytest.mark.parametrize("profile", GRID_PROFILES, ids=lambda p: p.name)
def test_the_closed_forms_are_the_general_bound_for_one_stage_per_rank(profile: Profile) -> None:
    for ranks, mbs in ((4, 8), (8, 32)):
        for limit in (ranks, 1.5 * ranks, 2 * ranks):
            problem = search_problem(ranks, mbs, cost=cost_for(registry.build("1f1b", ranks, mbs), profile),
                                     memory_limit=limit)
            assert makespan_bound(problem) == pytest.approx(bounds(ranks, mbs, profile, limit)["two_sided"])


def test_the_v_bound_proves_the_latency_target_out_of_reach() -> None:
    # 0.97 x zb-h1's 117 = 113.49 < 116.5: neither placement can get there at limit P.
    assert v_bound(8, 32, LATENCY, 8) == pytest.approx(116.5)
    row = case(4, 8, LATENCY, 4)
    assert row["bound"] == pytest.approx(min(row["two_sided"], row["v_bound"]))
    assert row["bound"] <= row["auto"]["makespan"] + 1e-9


def test_parts_run_alone_and_merge_with_earlier_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "auto.json"
    assert auto_search.main(["--quick", "--parts", "sweep", "--json", str(out), "--docs", "none"]) == 0
    assert "run --parts targets,grid,search_time" in capsys.readouterr().out
    first = json.loads(out.read_text())
    assert set(first) == {"quick", "sweep"} and first["sweep"]["P"] == 4
    for row in first["sweep"]["rows"]:
        assert min(row["linear_bound"], row["v_bound"]) <= min(row["linear"], row["v"]) + 1e-9
    assert auto_search.main(["--quick", "--parts", "bogus", "--json", str(out), "--docs", "none"]) == 2
    assert "--parts needs names from targets, grid, sweep, search_time, got 'bogus'" in capsys.readouterr().err


def test_one_case_and_its_report() -> None:
    row = case(2, 4, UNIFORM, 2)
    assert row["auto"]["makespan"] <= row["best_built_in_makespan"] + 1e-9
    assert row["best_built_in"] != "dualpipe" and set(row["auto"]["by_placement"]) == {"linear", "v"}
    results = {"targets": [{"target": "t", "cases": [row], "met": True}],
               "grid": {"rows": [row], "cases": 1, "worse": 0, "better": 0, "met": True, "greedy_wins": 0,
                        "dualpipe_cases": 0, "dualpipe_shorter": 0},
               "sweep": {"P": 2, "M": 4, "zb_h1": 10.0, "rows": [
                   {"limit": 2, "linear_bound": 10.0, "v_bound": 9.5, "linear": 10.0, "v": 9.5}]},
               "search_time": {"P": 2, "M": 4, "rows": [], "max_wall_s": 0.1, "met": True, "loadavg": [0, 0, 0]}}
    text = auto_search.markdown(results)
    assert "| t | 2 | 4 | 2 |" in text and "### Grid: 1 cases" in text
    assert "| 2 | 10 | 9.5 | 10 | 9.5 | 0.950 | yes |" in text
    assert "auto search: targets" in auto_search.text_report(results)


def test_figures_are_written(tmp_path: Path) -> None:
    sweep = {"P": 2, "M": 4, "zb_h1": 10.0, "rows": [
        {"limit": 2, "linear_bound": 10.0, "v_bound": 9.5, "linear": 10.0, "v": 9.5},
        {"limit": 4, "linear_bound": 9.0, "v_bound": 8.5, "linear": 9.0, "v": 9.0}]}
    auto_search.sweep_plot(sweep, str(tmp_path / "sweep.png"))
    auto_search.v_gantt(True, str(tmp_path / "gantt.png"))
    for name in ("sweep.png", "gantt.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
