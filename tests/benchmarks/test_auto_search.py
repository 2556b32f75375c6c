"""The auto-search benchmark's arithmetic: costs per part, the bounds it prints, one case and its report."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import auto_search
from benchmarks.auto_search import (
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
from duplexpipe.schedules import registry
from duplexpipe.schedules.generators.auto import search_problem
from duplexpipe.schedules.generators.bounds import makespan_bound


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


def test_sections_run_alone_and_keep_the_others_from_earlier_results(tmp_path: Path) -> None:
    first = auto_search.run(replace(auto_search.QUICK, sections=("sweep",)))
    assert set(first) == {"sweep"} and first["sweep"]["P"] == 4
    for row in first["sweep"]["rows"]:
        assert min(row["linear_bound"], row["v_bound"]) <= min(row["linear"], row["v"]) + 1e-9
    earlier = tmp_path / "results.json"
    earlier.write_text(json.dumps({"auto_search": {**first, "meta": {}}}))
    both = auto_search.run(replace(auto_search.QUICK, keep_from=str(earlier), sections=("search_time",)))
    assert set(both) == {"sweep", "search_time"} and both["sweep"] == first["sweep"]
    assert both["search_time"]["met"] and len(both["search_time"]["rows"]) == 8
    with pytest.raises(ValueError, match="unknown sections"):
        auto_search.run(auto_search.AutoSearchConfig(sections=("bogus",)))


def _results(row: dict) -> dict:
    return {"targets": [{"target": "t", "cases": [row], "met": True}],
            "grid": {"rows": [row], "cases": 1, "worse": 0, "better": 0, "met": True, "greedy_wins": 0, "at_bound": 1,
                     "bound_checked": 2, "bound_reached": 1, "bound_violated": [], "dualpipe_cases": 0,
                     "dualpipe_shorter": 0},
            "sweep": {"P": 2, "M": 4, "zb_h1": 10.0, "rows": [
                {"limit": 2, "linear_bound": 10.0, "v_bound": 9.5, "linear": 10.0, "v": 9.5},
                {"limit": 4, "linear_bound": 9.0, "v_bound": 8.5, "linear": 9.0, "v": 9.0}]},
            "search_time": {"P": 2, "M": 4, "rows": [], "max_wall_s": 0.1, "met": True, "loadavg": [0, 0, 0]}}


def test_one_case_and_its_report() -> None:
    row = case(2, 4, UNIFORM, 2)
    assert row["auto"]["makespan"] <= row["best_built_in_makespan"] + 1e-9
    assert row["best_built_in"] != "dualpipe" and set(row["auto"]["by_placement"]) == {"linear", "v"}
    blocks = auto_search.report(_results(row))
    tables = [b for b in blocks if isinstance(b, list)]
    assert [len(t) for t in tables] == [2, 1, 3, 1]  # one target case; no grid case differs; two limits; no timings
    assert len(set(map(len, tables[0]))) == 1 and tables[2][1][-1] in ("yes", "no", "no (unreachable)")
    assert auto_search.report({"sweep": _results(row)["sweep"]})[0].startswith("### Latency 0.5")


def test_figures_are_written(tmp_path: Path) -> None:
    made = auto_search.figures(_results(case(2, 4, UNIFORM, 2)), str(tmp_path))
    assert [name for name, _ in made] == ["auto_limit_sweep.png", "auto_v_bound.png"]
    for name, _ in made:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert auto_search.figures({}, str(tmp_path)) == []
