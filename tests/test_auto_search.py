"""The auto-search benchmark's arithmetic: costs per part, the bounds it prints, one case and its report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import auto_search  # noqa: E402
from benchmarks.auto_search import LATENCY, UNIFORM, W_LIGHT, Profile, bounds, case, cost_for  # noqa: E402
from duplexpipe.schedules import registry  # noqa: E402


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


def test_one_case_and_its_report() -> None:
    row = case(2, 4, UNIFORM, 2)
    assert row["auto"]["makespan"] <= row["best_built_in_makespan"] + 1e-9
    assert row["best_built_in"] != "dualpipe" and set(row["auto"]["by_placement"]) == {"linear", "v"}
    results = {"targets": [{"target": "t", "cases": [row], "met": True}],
               "grid": {"rows": [row], "cases": 1, "worse": 0, "better": 0, "met": True, "greedy_wins": 0,
                        "dualpipe_cases": 0, "dualpipe_shorter": 0},
               "search_time": {"P": 2, "M": 4, "rows": [], "max_wall_s": 0.1, "met": True, "loadavg": [0, 0, 0]}}
    text = auto_search.markdown(results)
    assert "| t | 2 | 4 | 2 |" in text and "### Grid: 1 cases" in text
    assert "auto search: targets" in auto_search.text_report(results)
