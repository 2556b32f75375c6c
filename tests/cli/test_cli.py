"""Tests of the `duplexpipe` command: every command, and every bad-input case exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from _viz_cases import as_measured, simulated

from duplexpipe.cli import main, schedule_cmds
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Op, Schedule, StageInfo, parse_action, save_json
from duplexpipe.schedules.simulate import CostModel, simulate

COMMANDS = ("schedules", "show", "verify", "simulate", "compare", "export", "plot")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, out: str, err: str, needle: str) -> None:
    """The CLI's bad-input contract: exit 2, one line on stderr naming `needle`, no traceback."""
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("duplexpipe: error:"), err
    assert needle in err, err
    assert "Traceback" not in err + out


def test_schedules_lists_every_name_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schedules")
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(registry.names())
    assert all(len(line.split()) > 2 for line in lines), "each schedule needs a description"
    assert "[options: chunks]" in lines[list(registry.names()).index("interleaved-1f1b")]


def test_show_prints_one_row_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "1f1b", "-p", "4", "-m", "8")
    assert code == 0
    assert "0F0" in out and "3B7" in out
    code, out, _ = run(capsys, "show", "dualpipe", "--ranks", "4", "--microbatches", "8", "--comms")
    assert code == 0 and "SEND_F" in out and "RECV_B" in out


def test_simulate_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("schedule", "ranks", "microbatches", "makespan", "bubble_ratio", "per_rank", "costs_per", "cost"):
        assert key in data
    assert data["ranks"] == 4 and len(data["per_rank"]) == 4
    # 1F1B, F=1 B=2: makespan (M + P - 1)(F + B) = 33, idle (P-1)(F+B) = 9 on every rank
    assert data["makespan"] == pytest.approx(33)
    assert [r["idle"] for r in data["per_rank"]] == pytest.approx([9] * 4)
    assert [r["peak_activations"] for r in data["per_rank"]] == [4, 3, 2, 1]
    assert data["costs_per"] == "model-part" and data["cost"]["stage_scale"] is True


def test_simulate_text_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "gpipe", "-p", "2", "-m", "4", "--cost", "F=2,B=4,W=1")
    assert code == 0 and "makespan=30" in out
    assert "costs per 1/P of the model: F=2 B=4 W=1" in out


def test_simulate_scales_linearly_to_ten_thousand_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "10000", "-m", "2", "--json")
    assert code == 0
    assert json.loads(out)["makespan"] == pytest.approx((2 + 10000 - 1) * 3)  # (M + P - 1)(F + B)


def test_a_plan_over_the_limit_is_refused_before_building(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(registry, "build", _must_not_run)
    one_line_error(*run(capsys, "simulate", "1f1b", "-p", "100000", "-m", "8"), "limit of 500,000")
    one_line_error(*run(capsys, "show", "interleaved-1f1b", "-p", "1000", "-m", "100", "--opt", "chunks=8"),
                   "P x M x chunks = 800,000")


def _must_not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("expensive work ran before the input was checked")


def test_schedule_files_over_the_limits_are_refused_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A 200 MB schedule file (sparse) by its size; P x M over the limit by the header, before the actions (here
    unparseable) are read; a timeline file by its size."""
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(200 * 2**20)
    one_line_error(*run(capsys, "verify", str(huge)), "is 209,715,200 bytes, over the 128 MiB limit")
    wide = tmp_path / "wide.json"
    wide.write_text('{"format": "duplexpipe-schedule", "version": 1, "name": "x", "num_ranks": 2000, '
                    '"num_microbatches": 1000, "stages": [], "actions": [["not an action"]]}')
    monkeypatch.setattr("duplexpipe.cli.args.load_json", _must_not_run)
    one_line_error(*run(capsys, "verify", str(wide)), "P=2000 M=1000: P x M = 2,000,000 is over the command line's "
                                                      "limit of 500,000")
    timeline = tmp_path / "timeline.json"
    with open(timeline, "wb") as fh:
        fh.truncate(300 * 2**20)
    one_line_error(*run(capsys, "plot", str(timeline), "-o", str(tmp_path / "t.png")),
                   "over the 256 MiB limit for a timeline file")


@pytest.mark.parametrize("name", [n for n in registry.names() if registry.check(n, 4, 8) is None])
def test_simulate_and_compare_agree_by_default(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", name, "-p", "4", "-m", "8", "--json")
    table = json.loads(out)
    assert code == 0 and table["costs_per"] == "model-part"
    code, out, _ = run(capsys, "simulate", name, "-p", "4", "-m", "8", "--json")
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(table["schedules"][0]["makespan"])
    for per, scale in (("model-part", True), ("stage", False)):
        code, out, _ = run(capsys, "simulate", name, "-p", "4", "-m", "8", "--json", "--costs-per", per)
        expected = simulate(registry.build(name, 4, 8), CostModel(stage_scale=scale)).makespan
        assert json.loads(out)["makespan"] == pytest.approx(expected)


def test_the_cost_convention_is_printed_and_explicit(capsys: pytest.CaptureFixture[str]) -> None:
    # interleaved 1F1B cuts the model into 2P stages: per 1/P of the model each stage takes half the cost
    code, out, _ = run(capsys, "simulate", "interleaved-1f1b", "-p", "4", "-m", "8")
    assert code == 0 and "makespan=28.5" in out
    assert "costs per 1/P of the model" in out and "each stage takes 0.5x" in out
    code, out, _ = run(capsys, "simulate", "interleaved-1f1b", "-p", "4", "-m", "8", "--costs-per", "stage")
    assert code == 0 and "makespan=57" in out and "costs per stage" in out
    code, out, _ = run(capsys, "compare", "interleaved-1f1b", "-p", "4", "-m", "8", "--costs-per", "stage")
    assert code == 0 and " 57.00 " in out and "costs per stage" in out
    code, out, _ = run(capsys, "simulate", "zbv", "-p", "4", "-m", "8", "--cost", "stage_scale=false")
    assert code == 0 and "costs per stage" in out  # the cost string's own key is honoured
    one_line_error(*run(capsys, "simulate", "zbv", "-p", "4", "-m", "8", "--cost", "stage_scale=false",
                        "--costs-per", "model-part"), "contradicts --costs-per model-part")


def test_stage_costs_reach_the_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--stage-cost", "3:F=1.5,B=3", "--json")
    heavy = simulate(registry.build("1f1b", 4, 8), CostModel(stage_costs={3: (1.5, 3.0, 1.0)}))
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(heavy.makespan)
    assert heavy.makespan > 33  # the heavy last stage is the bottleneck
    code, out, _ = run(capsys, "simulate", "zbv", "-p", "4", "-m", "8", "--stage-cost", "0-7:F=2", "--json")
    code2, out2, _ = run(capsys, "simulate", "zbv", "-p", "4", "-m", "8", "--cost", "F=2", "--json")
    assert code == code2 == 0 and json.loads(out)["makespan"] == json.loads(out2)["makespan"]
    one_line_error(*run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--stage-cost", "5:F=2"),
                   "stage_costs names stages [5]")


def test_opt_goes_to_the_generator(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "interleaved-1f1b", "-p", "2", "-m", "4", "--opt", "chunks=3")
    assert code == 0 and "6 stages" in out and "5F3" in out
    code, out, _ = run(capsys, "compare", "1f1b", "interleaved-1f1b", "-p", "4", "-m", "8", "--opt", "chunks=4",
                       "--costs-per", "stage", "--json")
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    by_api = simulate(registry.build("interleaved-1f1b", 4, 8, chunks=4)).makespan
    assert code == 0 and rows["interleaved-1f1b"]["makespan"] == pytest.approx(by_api)
    one_line_error(*run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--opt", "chunks=3"),
                   "does not take option(s) chunks")
    one_line_error(*run(capsys, "compare", "-p", "4", "-m", "8", "--opt", "chunkz=3"), "chunkz")


def test_generators_that_plan_by_cost_get_the_cost_model(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Any] = []

    def planned(num_ranks: int, num_microbatches: int, cost: Any = None, memory_limit: int = 0) -> Schedule:
        seen.append((cost, memory_limit))
        return registry.build("1f1b", num_ranks, num_microbatches)

    entry = registry.Entry(planned, lambda *a, **k: None, "plans by cost", ("cost", "memory_limit"))
    monkeypatch.setattr(registry, "REGISTRY", MappingProxyType({**registry.REGISTRY, "planned": entry}))
    code, _, _ = run(capsys, "simulate", "planned", "-p", "2", "-m", "4", "--cost", "F=3,B=4",
                     "--stage-cost", "1:B=5", "--opt", "memory_limit=7")
    assert code == 0
    cost, limit = seen[-1]
    assert (cost.f, cost.b, cost.stage_scale, dict(cost.stage_costs), limit) == (3.0, 4.0, True,
                                                                                 {1: (3.0, 5.0, 1.0)}, 7)
    for command in (["show"], ["verify"], ["export", "--format", "json", "-o", os.devnull], ["compare"]):
        assert run(capsys, command[0], "planned", "-p", "2", "-m", "4", *command[1:])[0] == 0
        assert seen[-1][0] == CostModel(stage_scale=True)
    code, _, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--cost", "F=3")
    assert code == 0 and len(seen) == 5, "generators without a cost option get none"


def test_compare_covers_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--json")
    assert code == 0
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    assert set(rows) == set(registry.names())
    assert rows["dualpipe"]["params_per_rank"] == 2.0 and rows["1f1b"]["params_per_rank"] == 1.0
    assert rows["zb-h1"]["bubble_ratio"] < rows["1f1b"]["bubble_ratio"]
    code, out, _ = run(capsys, "compare", "-p", "3", "-m", "6")
    assert code == 0 and "dualpipe" in out and "skipped" in out


def test_compare_chosen_schedules_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine.json"
    save_json(registry.build("zb-h1", 2, 4), str(mine))
    code, out, _ = run(capsys, "compare", "1f1b", "zbv", str(mine), "-p", "4", "-m", "8", "--json")
    assert code == 0
    rows = json.loads(out)["schedules"]
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv", str(mine)]
    assert (rows[2]["ranks"], rows[2]["microbatches"]) == (2, 4), "a file keeps its own P and M"
    assert rows[2]["makespan"] == pytest.approx(simulate(registry.build("zb-h1", 2, 4)).makespan)
    code, out, _ = run(capsys, "compare", str(mine), "1f1b", "-p", "4", "-m", "8")
    lines = out.splitlines()
    assert code == 0 and lines[2].startswith(str(mine)) and lines[3].startswith("1f1b") and " P " in lines[1]
    code, out, _ = run(capsys, "compare", str(mine))
    assert code == 0 and "P=2 M=4" in out
    one_line_error(*run(capsys, "compare", "dualpipe", "-p", "3", "-m", "6"), "3")  # named: not skipped


def test_export_and_verify_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in (n for n in registry.names() if registry.check(n, 4, 8) is None and n != "dualpipe"):
        for fmt, ext, comms in (("json", "json", ()), ("torch-csv", "csv", ()), ("torch-csv", "csv", ("--comms",))):
            path = tmp_path / f"{name}.{ext}"
            code, _, _ = run(capsys, "export", name, "-p", "4", "-m", "8", "--format", fmt, "-o", str(path), *comms)
            assert code == 0 and path.exists()
            code, out, _ = run(capsys, "verify", str(path))
            assert code == 0 and out.startswith("OK"), (name, fmt, out)


def test_export_refuses_a_csv_that_cannot_hold_two_copies(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "d.csv"
    one_line_error(*run(capsys, "export", "dualpipe", "-p", "4", "-m", "8", "--format", "torch-csv", "-o",
                        str(path)), "--format json")
    assert not path.exists()
    src, dst = tmp_path / "s.json", tmp_path / "s.csv"
    assert run(capsys, "export", "dualpipe", "-p", "4", "-m", "8", "--format", "json", "-o", str(src))[0] == 0
    one_line_error(*run(capsys, "export", str(src), "--format", "torch-csv", "-o", str(dst)), "2 model copies")
    code, out, _ = run(capsys, "verify", str(src))
    assert code == 0 and out.startswith("OK")


def test_export_converts_a_file_between_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = tmp_path / "s.json", tmp_path / "s.csv"
    assert run(capsys, "export", "dualpipev", "-p", "4", "-m", "8", "--format", "json", "-o", str(src))[0] == 0
    assert run(capsys, "export", str(src), "--format", "torch-csv", "-o", str(dst))[0] == 0
    rows = dst.read_text().splitlines()
    assert len(rows) == 4 and rows[0].split(",")[0] == "0F0"
    code, _, err = run(capsys, "export", "1f1b", "--format", "json", "-o", str(dst))
    assert code == 2 and "--ranks" in err


def _deadlocked(tmp_path: Path) -> Path:
    f, b = Op.F, Op.B
    rows = (
        (Action(0, f, 0), Action(0, Op.RECV_B, 0), Action(0, b, 0), Action(0, Op.SEND_F, 0)),
        (Action(1, Op.RECV_F, 0), Action(1, f, 0), Action(1, b, 0), Action(1, Op.SEND_B, 0)),
    )
    sched = Schedule("broken", 2, 1, (StageInfo(0, 0), StageInfo(1, 1)), rows)
    path = tmp_path / "broken.json"
    save_json(sched, str(path))
    return path


def test_verify_reports_a_deadlock_with_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", str(_deadlocked(tmp_path)))
    assert code == 1
    assert "0B0" in out and "1F0" in out


def test_verify_nccl_checks_the_pair_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a lowered 1F1B, sound under the contract, but rank 0 posts RECV_B0 before SEND_F1
    # while rank 1 posts RECV_F1 before SEND_B0: on NCCL's one stream per pair, a hang
    rows = ("0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1")
    sched = Schedule("crossed", 2, 2, (StageInfo(0, 0), StageInfo(1, 1)),
                     tuple(tuple(parse_action(t) for t in row.split()) for row in rows))
    path = tmp_path / "crossed.json"
    save_json(sched, str(path))
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 0 and out.startswith("OK") and "NCCL" not in out
    code, out, _ = run(capsys, "verify", str(path), "--nccl")
    assert code == 1 and out.startswith("UNSOUND crossed")
    assert "ranks 0 and 1 disagree" in out and "0RECV_B0" in out and "1RECV_F1" in out
    code, out, _ = run(capsys, "verify", "gpipe", "-p", "4", "-m", "8", "--nccl")  # lowered by us: safe
    assert code == 0 and out.startswith("OK") and "NCCL pair order" in out


def _timeline_file(tmp_path: Path, name: str = "dualpipe") -> Path:
    """A measured timeline as `duplexpipe train --out-dir` writes it (Timeline.to_dict() JSON)."""
    measured = as_measured(simulated(name)[1], 0.004, origin=100.0)
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(measured.to_dict()) + "\n")
    return path


def test_plot_draws_a_timeline_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    imread = pytest.importorskip("matplotlib.image").imread
    path = _timeline_file(tmp_path)
    code, out, _ = run(capsys, "plot", str(path))
    assert code == 0 and "measured dualpipe: 4 ranks, 8 microbatches" in out
    png = tmp_path / "timeline.png"
    assert f"plot written to {png}" in out and imread(png).shape[1] == 1800
    svg = tmp_path / "part.svg"
    code, _, _ = run(capsys, "plot", str(path), "-o", str(svg), "--ranks-shown", "0,3", "--window", "0:40",
                     "--no-activations")
    text = svg.read_text()
    shown = {part.split("-")[0] for part in text.split('id="dpbox-0-r')[1:]}
    assert code == 0 and shown == {"0", "3"}
    one_line_error(*run(capsys, "plot", str(path), "--ranks-shown", "0-4"), "rank 4")
    one_line_error(*run(capsys, "plot", str(path), "--window", "900:"), "shows nothing")


BAD_TIMELINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a timeline"),
    ('{"ranks": 2}', "not a timeline"),
    ('{"schedule": "x", "ranks": 2, "microbatches": 1, "events": [[0, "0Q0", 0, 1]]}', "0Q0"),
    ('{"schedule": "x", "ranks": 2, "microbatches": 1, "events": [[0, "0F0", 0]]}', "malformed timeline"),
    ('{"schedule": "x", "ranks": 2, "microbatches": 1, "events": []}', "no events"),
    ('{"schedule": "x", "ranks": 1, "microbatches": 1, "events": [[3, "0F0", 0, 1]]}', "ranks [3]"),
    ('{"format": "duplexpipe-schedule"}', "is a schedule, not a timeline"),
    ('{"schedule": "x", "ranks": 1, "microbatches": 1, "events": [[0, "0F0", NaN, 1]]}', "from nan to 1.0"),
    ('{"schedule": "x", "ranks": 1, "microbatches": 1, "events": [[0, "0F0", 2, 1]]}', "from 2.0 to 1.0"),
    ('{"schedule": "x", "ranks": 1, "microbatches": 1, "events": [[0, "0F0", -1e308, 1e308]]}', "overflow"),
    ('{"schedule": "x", "ranks": 100000000, "microbatches": 1, "events": [[0, "0F0", 0, 1]]}', "1..100,000"),
]


@pytest.mark.parametrize("content,needle", BAD_TIMELINES, ids=[b[1] for b in BAD_TIMELINES])
def test_plot_rejects_bad_timeline_files(content: str, needle: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    one_line_error(*run(capsys, "plot", str(path)), needle)
    assert not (tmp_path / "t.png").exists()


BAD_INPUTS = [
    ("unknown schedule", ["simulate", "nosuch", "-p", "4", "-m", "8"], "nosuch"),
    ("odd ranks for dualpipe", ["simulate", "dualpipe", "-p", "3", "-m", "8"], "3"),
    ("too few microbatches", ["verify", "dualpipe", "-p", "4", "-m", "2"], "2"),
    ("zero ranks", ["show", "1f1b", "-p", "0", "-m", "8"], "0"),
    ("non-integer", ["compare", "-p", "four", "-m", "8"], "four"),
    ("missing P/M", ["simulate", "1f1b"], "--ranks"),
    ("compare without P/M", ["compare"], "--ranks"),
    ("bad cost key", ["simulate", "1f1b", "-p", "2", "-m", "2", "--cost", "Q=1"], "Q"),
    ("bad cost value", ["simulate", "1f1b", "-p", "2", "-m", "2", "--cost", "F=abc"], "abc"),
    ("bad stage cost", ["simulate", "1f1b", "-p", "2", "-m", "2", "--stage-cost", "1F=2"], "1F=2"),
    ("bad costs-per", ["simulate", "1f1b", "-p", "2", "-m", "2", "--costs-per", "rank"], "rank"),
    ("bad opt", ["show", "interleaved-1f1b", "-p", "2", "-m", "4", "--opt", "chunks"], "KEY=VALUE"),
    ("opt value rejected", ["show", "interleaved-1f1b", "-p", "2", "-m", "4", "--opt", "chunks=1"], "chunks"),
    ("missing file", ["verify", "/nonexistent/s.json"], "/nonexistent/s.json"),
    ("file under a file", ["verify", "/dev/null/s.json"], "Not a directory"),
    ("a directory as a schedule", ["verify", "/tmp"], "is a directory"),
    ("opt with a file", ["verify", "/nonexistent/s.json", "--opt", "chunks=2"], "is a file"),
    ("bad format", ["export", "1f1b", "-p", "2", "-m", "2", "--format", "xml", "-o", "x"], "xml"),
    ("no command", [], "COMMAND"),
    ("plot dir missing", ["simulate", "1f1b", "-p", "2", "-m", "2", "--plot", "/nonexistent/dir/x.png"],
     "/nonexistent/dir does not exist"),
    ("plot format", ["simulate", "1f1b", "-p", "2", "-m", "2", "--plot", "x.jpg"], "'.jpg'"),
    ("trace dir missing", ["simulate", "1f1b", "-p", "2", "-m", "2", "--trace", "/nonexistent/t.json"],
     "/nonexistent does not exist"),
    ("compare plot dir missing", ["compare", "-p", "2", "-m", "2", "--plot", "/nonexistent/c.png"], "/nonexistent"),
    ("export dir missing", ["export", "1f1b", "-p", "2", "-m", "2", "--format", "json", "-o", "/nonexistent/e.json"],
     "/nonexistent does not exist"),
    ("output is a directory", ["export", "1f1b", "-p", "2", "-m", "2", "--format", "json", "-o", "/tmp"],
     "is a directory"),
    ("output under a file", ["simulate", "1f1b", "-p", "2", "-m", "2", "--trace", "/dev/null/t.json"],
     "is not a directory"),
    ("plot output dir missing", ["plot", "/nonexistent/t.json", "-o", "/nonexistent/t.png"], "/nonexistent"),
    ("plot missing timeline", ["plot", "/nonexistent/t.json", "-o", os.devnull + ".png"], "/nonexistent/t.json"),
    ("view without plot", ["simulate", "1f1b", "-p", "2", "-m", "2", "--window", "0:5"], "need --plot"),
    ("rank shown out of range", ["simulate", "1f1b", "-p", "2", "-m", "2", "--plot", "x.png", "--ranks-shown", "5"],
     "rank 5"),
    ("bad rank list", ["simulate", "1f1b", "-p", "2", "-m", "2", "--plot", "x.png", "--ranks-shown", "3-1"], "3-1"),
    ("bad window", ["simulate", "1f1b", "-p", "2", "-m", "2", "--plot", "x.png", "--window", "5"], "START:END"),
    ("too many ranks to draw", ["simulate", "1f1b", "-p", "200000", "-m", "1", "--plot", "x.png"], "--ranks-shown"),
]


@pytest.mark.parametrize("label,argv,needle", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(label: str, argv: list[str], needle: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("duplexpipe.schedules.simulate.simulate", _must_not_run)
    one_line_error(*run(capsys, *argv), needle)


def test_outputs_are_checked_before_the_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(registry, "build", _must_not_run)
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path))
    for argv in (["simulate", "1f1b", "-p", "2", "-m", "2", "--plot"], ["simulate", "1f1b", "-p", "2", "-m", "2",
                 "--trace"], ["compare", "-p", "2", "-m", "2", "--plot"], ["export", "1f1b", "-p", "2", "-m", "2",
                 "--format", "json", "-o"]):
        one_line_error(*run(capsys, *argv, str(tmp_path / "out.png")), "permission denied")


def test_plots_without_matplotlib_give_the_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    timeline = _timeline_file(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setattr(registry, "build", _must_not_run)
    hint = "pip install 'duplexpipe[viz]'"
    one_line_error(*run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--plot", str(tmp_path / "x.png")), hint)
    one_line_error(*run(capsys, "compare", "-p", "2", "-m", "2", "--plot", str(tmp_path / "x.png")), hint)
    one_line_error(*run(capsys, "plot", str(timeline)), hint)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--trace", str(tmp_path / "t.json"))
    assert code == 0, "a trace needs no matplotlib"


@pytest.mark.parametrize("error,code,needle", [
    (PermissionError(13, "Permission denied", "/x/out.json"), 2, "/x/out.json: Permission denied"),
    (OSError(28, "No space left on device"), 2, "No space left"),
    (MemoryError(), 2, "out of memory"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_failures_while_working_are_one_line(error: BaseException, code: int, needle: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(schedule_cmds, "save_json", fail)
    got, out, err = run(capsys, "export", "1f1b", "-p", "2", "-m", "2", "--format", "json", "-o", os.devnull)
    assert got == code and err.count("\n") == 1 and needle in err and "Traceback" not in err + out


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ("[" * 100000, "not valid JSON"),
    ('{"format": "duplexpipe-schedule", "version": 1, "name": "x", "num_ranks": 1, "num_microbatches": 1, '
     '"stages": [{"rank": 0, "group": 0}], "actions": [["0F0", "0Q0"]]}', "0Q0"),
])
def test_malformed_json_files(tmp_path: Path, content: str, needle: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    one_line_error(*run(capsys, "verify", str(path)), needle)


def test_malformed_csv_names_line_and_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1X0\n")
    code, _, err = run(capsys, "verify", str(path))
    assert code == 2 and "line 2" in err and "1X0" in err
    path.write_bytes(b"\xff\xfe\x00binary")
    one_line_error(*run(capsys, "verify", str(path)), "not a text file")


def test_a_file_must_agree_with_the_given_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    save_json(registry.build("1f1b", 2, 4), str(path))
    one_line_error(*run(capsys, "simulate", str(path), "-p", "4"), "holds 2 ranks, but -p 4")
    assert run(capsys, "simulate", str(path), "-p", "2", "-m", "4")[0] == 0


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples_and_exit_codes(command: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "example" in out and "exit codes:" in out and f"duplexpipe {command}" in out


def test_console_script_help_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "duplexpipe.cli", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for command in (*COMMANDS, "train"):
        assert command in proc.stdout


def test_verify_refuses_mis_ordered_zero3_collectives_naming_the_cycle(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "zero3.json"
    code, out, _ = run(capsys, "export", "dualpipe", "-p", "2", "-m", "4", "--zero-stage", "3", "--comms",
                       "--format", "json", "-o", str(path))
    assert code == 0
    data = json.loads(path.read_text())
    assert data["actions"][0][-2:] == ["0REDUCE_GRAD", "3REDUCE_GRAD"]
    assert run(capsys, "verify", str(path))[0] == 0
    data["actions"][0][-2:] = ["3REDUCE_GRAD", "0REDUCE_GRAD"]
    path.write_text(json.dumps(data))
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 1
    assert "cycle: rank 0: 3REDUCE_GRAD -> 0REDUCE_GRAD => rank 1: 2REDUCE_GRAD -> 1REDUCE_GRAD" in out


def test_simulate_zero3_shows_gathers_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "zbv", "-p", "2", "-m", "4", "--zero-stage", "3", "--reshard-window",
                       "1", "--cost", "param_bytes=1e8,dp=4,dp_bandwidth=1e8", "--json")
    assert code == 0
    result = json.loads(out)
    assert [r["all_gathers"] for r in result["per_rank"]] == [7, 13]
    assert result["step_time"] > result["makespan"] and result["per_rank"][0]["peak_param_bytes"] > 0
    code, out, _ = run(capsys, "simulate", "zbv", "-p", "2", "-m", "4", "--zero-stage", "3", "--cost",
                       "param_bytes=1e8,dp=4")
    assert code == 0 and "gathers peak_params peak_grads" in out


@pytest.mark.parametrize("argv,needle", [
    (("--reshard-window", "1"), "--reshard-window needs --zero-stage 3"),
    (("--zero-stage", "3", "--reshard-window", "3"), "reshard window must be a whole number of stages from 1 to 2"),
    (("--zero-stage", "3", "--unshard-lookahead", "-1"), "lookahead must be a whole number"),
])
def test_zero3_flags_refuse_bad_values(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                       needle: str) -> None:
    code, out, err = run(capsys, "verify", "zbv", "-p", "2", "-m", "4", *argv)
    assert code == 2 and needle in err
