"""benchmarks.runner on the first four parts' smoke runs: results.json, figures, docs, numbers, --replot."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import runner

PARTS = ("vs_torch", "measured_vs_sim", "overlap", "schedule_tooling")
STAT_KEYS = {"median_s", "q1_s", "q3_s", "n"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Path]:
    out, docs = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("docs")
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nprose before\n\n<!-- bench:vs-torch:begin -->\nold\n"
                                        "<!-- bench:vs-torch:end -->\n\nprose after\n", encoding="utf-8")
    assert runner.main(["--quick", "--parts", ",".join(PARTS), "--out", str(out), "--docs", str(docs)]) == 0
    return json.loads((out / "results.json").read_text()), out, docs


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.timeout(300)
def test_every_part_is_recorded_with_how_it_ran(quick: tuple[dict[str, Any], Path, Path]) -> None:
    results, _, _ = quick
    assert set(results) == set(PARTS)
    for part in PARTS:
        meta = results[part]["meta"]
        assert meta["quick"] is True and meta["command"].startswith("python -m benchmarks --quick")
        assert meta["wall_s"] > 0 and meta["machine"]["cores"] >= 1 and len(meta["load_before"]) == 3


@pytest.mark.timeout(300)
def test_each_part_writes_its_own_docs_block(quick: tuple[dict[str, Any], Path, Path]) -> None:
    _, _, docs = quick
    text = (docs / "benchmarks.md").read_text()
    blocks = re.findall(r"<!-- bench:([\w-]+):begin -->\n(.*?)<!-- bench:\1:end -->", text, re.S)
    assert [name for name, _ in blocks] == ["vs-torch", "measured-vs-sim", "overlap", "schedule-tooling"]
    assert all(body.startswith("Run on ") for _, body in blocks)
    assert "old" not in text
    assert text.index("prose before") < text.index("bench:vs-torch:begin") < text.index("prose after")
    for name in re.findall(r"!\[[^]]*\]\(img/([^)]+)\)", text):
        assert (docs / "img" / name).stat().st_size > 1000
    assert {"bench_ratios.png", "bench_sim_ratio.png", "bench_measured_vs_sim.png", "bench_overlap.png",
            "bench_tooling.png"} <= {p.name for p in (docs / "img").iterdir()}


@pytest.mark.timeout(300)
def test_replot_publishes_again_without_measuring(quick: tuple[dict[str, Any], Path, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    results, out, _ = quick
    assert runner.main(["--replot", "--parts", "overlap", "--out", str(out), "--docs", "none"]) == 0
    assert json.loads((out / "results.json").read_text()) == results
    assert "3. Communication overlap" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_vs_torch_rows(quick: tuple[dict[str, Any], Path, Path]) -> None:
    rows = quick[0]["vs_torch"]["rows"]
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv"]
    for r in rows:
        assert STAT_KEYS <= set(r["ours"]) and STAT_KEYS <= set(r["torch"]) and r["ours"]["n"] == 2
        assert r["ratio"] == pytest.approx(r["ours"]["median_s"] / r["torch"]["median_s"])
        assert r["grads_match"] == {"ours": True, "torch": True}, r["grad_error"]
        assert len(r["samples"]["ours"]) == len(r["samples"]["torch"]) == 2
        assert _finite(*r["cpu_ms"].values(), r["paired_ratio"]["median_s"]) and set(r["cpu_ms"]) == {"ours", "torch"}


@pytest.mark.timeout(300)
def test_measured_vs_simulated_rows(quick: tuple[dict[str, Any], Path, Path]) -> None:
    rows = quick[0]["measured_vs_sim"]["rows"]
    assert [r["schedule"] for r in rows] == ["1f1b", "dualpipe"]
    for r in rows:
        assert _finite(r["simulated_makespan_s"], r["step"]["median_s"], r["simulated_calibrated_s"])
        assert r["ratio"] == pytest.approx(r["step"]["median_s"] / r["simulated_makespan_s"])
        assert 0.0 <= r["bubble_measured"] < 1.0 and 0.0 <= r["bubble_simulated"] < 1.0
        assert {e[0] for e in r["measured_timeline"]["events"]} == {0, 1}
        assert r["calibrated_costs_ms"]["f"] >= r["costs_ms"]["f"] * 0.9  # sleeps overshoot, never undershoot much
        assert r["handoff_gap_ms"]["count"] >= 0


@pytest.mark.timeout(300)
def test_overlap_and_tooling_figures(quick: tuple[dict[str, Any], Path, Path]) -> None:
    overlap = quick[0]["overlap"]
    (row,) = overlap["rows"]
    assert row["speedup"] == pytest.approx(row["waited"]["median_s"] / row["async"]["median_s"])
    assert _finite(overlap["probe"]["late_post_wait_s"], overlap["probe"]["early_post_wait_s"])
    tooling = quick[0]["schedule_tooling"]
    assert tooling["rows"] and tooling["vs_torch"]
    for r in [tooling["headline"], *tooling["rows"]]:
        assert r["total_s"] >= r["build_s"] > 0 and r["actions"] > 0
    assert all(r["torch_get_schedule_ops_s"] > 0 and r["speedup"] > 0 for r in tooling["vs_torch"])


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--parts", "bogus"], "unknown part 'bogus'"),
                         (["--parts", "overlap,vs_torch", "--set", "reps=1"], "name exactly one part"),
                         (["--parts", "overlap", "--set", "reps=0,1"], "reps")):
        with pytest.raises(SystemExit) as exc:
            runner.main(argv)
        assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_make_bench_runs_the_parts_in_the_runners_order() -> None:
    parts = [runner.load(name) for name in runner.PARTS]
    assert [p.name for p in parts] == list(runner.PARTS)
    assert [p.name for p in parts if not p.in_bench] == ["compression", "cuda_overlap", "float8_bench", "data_memory"]
    assert len({p.title for p in parts}) == len(parts)


def test_the_recorded_command_names_no_folder_of_the_machine() -> None:
    given = ["--out", "/scratch/run1", "--docs", "none", "--load-note", "busy", "--set", "reps=3"]
    assert runner._command("spawn_bench", given) == ("python -m benchmarks.spawn_bench --out DIR --docs none "
                                                     "--load-note NOTE --set reps=3")
