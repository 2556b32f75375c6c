"""Tests of the command line's value parsers: generator options, rank lists, windows, costs, paths, files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from duplexpipe.cli.args import (
    CliError,
    check_output,
    check_size,
    cost_model,
    load_schedule,
    load_timeline,
    parse_opts,
    parse_ranks,
    parse_value,
    parse_window,
)
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import save_json
from duplexpipe.schedules.simulate import CostModel
from duplexpipe.schedules.timeline import Timeline


@pytest.mark.parametrize("text,value", [
    ("4", 4), ("-2", -2), ("1e3", 1000.0), ("0.5", 0.5), ("true", True), ("False", False), ("fifo", "fifo"),
    ("", ""),
])
def test_option_values_are_literals(text: str, value: object) -> None:
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_opts_are_keyword_options() -> None:
    assert parse_opts(["chunks=3", "memory_limit = 2.5", "mode=fast"]) == {"chunks": 3, "memory_limit": 2.5,
                                                                         "mode": "fast"}
    assert parse_opts([]) == {}
    for bad, needle in (("chunks", "KEY=VALUE"), ("=3", "KEY=VALUE"), ("a-b=1", "KEY=VALUE"),
                        ("cost=1", "--cost")):
        with pytest.raises(CliError, match=needle):
            parse_opts([bad])
    with pytest.raises(CliError, match="twice"):
        parse_opts(["chunks=2", "chunks=3"])


def test_rank_lists() -> None:
    assert parse_ranks("0-3,60-61") == (0, 1, 2, 3, 60, 61)
    assert parse_ranks("5") == (5,) and parse_ranks("7,2") == (7, 2)
    for bad, needle in (("a", "0-7,60-63"), ("3-1", "LOW <= HIGH"), ("-1", "0-7"), ("0-2,2", r"rank\(s\) \[2\]"),
                        ("", "0-7")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse_ranks(bad)


def test_windows() -> None:
    assert parse_window("100:250") == (100.0, 250.0)
    assert parse_window("100:") == (100.0, None) and parse_window(":2.5") == (None, 2.5)
    assert parse_window(":") == (None, None)
    for bad, needle in (("100", "START:END"), ("a:b", "START:END"), ("5:5", "less than"), ("nan:1", "finite"),
                        ("0:inf", "finite")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse_window(bad)


def test_cost_model_conventions_and_stage_costs() -> None:
    assert cost_model("", [], None) == CostModel(stage_scale=True)
    assert cost_model("F=2", [], "stage") == CostModel(f=2.0)
    assert cost_model("stage_scale=no", [], None).stage_scale is False
    assert cost_model("STAGE_SCALE=yes", [], "model-part").stage_scale is True
    with pytest.raises(CliError, match="contradicts"):
        cost_model("stage_scale=yes", [], "stage")
    got = cost_model("F=1,B=4,W=2", ["3:F=1.5,B=3", "0-1:w=0.5"], None)
    assert dict(got.stage_costs) == {3: (1.5, 3.0, 2.0), 0: (1.0, 4.0, 0.5), 1: (1.0, 4.0, 0.5)}


@pytest.mark.parametrize("item,needle", [
    ("3F=1", "STAGES:KEY=VALUE"), ("x:F=1", "STAGES:KEY=VALUE"), ("3:Q=1", "'Q=1'"), ("3:F", "'F'"),
    ("3:F=abc", "'abc'"), ("3-1:F=1", "low to high"), ("3:W=5", "w=5.0 exceeds b=2.0"), ("3:F=-1", "-1"),
])
def test_bad_stage_costs_name_the_problem(item: str, needle: str) -> None:
    with pytest.raises(CliError) as err:
        cost_model("", [item], None)
    assert needle in str(err.value)
    with pytest.raises(CliError, match="stage 2 more than once"):
        cost_model("", ["0-2:F=1", "2:B=3"], None)


def test_size_limit_counts_ranks_microbatches_and_chunks() -> None:
    check_size("1f1b", 10000, 8, {})
    check_size("1f1b", 500_000, 1, {})
    with pytest.raises(CliError, match="P x M = 500,001"):
        check_size("1f1b", 500_001, 1, {})
    with pytest.raises(CliError, match="P x M x chunks = 800,000"):
        check_size("interleaved-1f1b", 1000, 100, {"chunks": 8})


def test_check_output(tmp_path: Path) -> None:
    check_output(str(tmp_path / "a.png"), "--plot", figure=True)
    check_output(str(tmp_path / "a.anything"), "-o")
    (tmp_path / "file").write_text("x")
    for path, figure, needle in ((tmp_path / "a.gif", True, "'.gif'"), (tmp_path, False, "is a directory"),
                                 (tmp_path / "no" / "a.png", True, "does not exist"),
                                 (tmp_path / "file" / "a.json", False, "is not a directory")):
        with pytest.raises(CliError, match=needle):
            check_output(str(path), "--x", figure=figure)
    assert not list(tmp_path.glob("a.*")), "checking writes nothing"


def test_load_schedule_from_names_and_files(tmp_path: Path) -> None:
    assert load_schedule("zbv", 2, 4).actions == registry.build("zbv", 2, 4).actions
    assert load_schedule("interleaved-1f1b", 2, 4, {"chunks": 3}).num_stages == 6
    path = tmp_path / "s.json"
    save_json(registry.build("zb-h1", 2, 4), str(path))
    assert load_schedule(str(path), None, None).name == "zb-h1"
    with pytest.raises(CliError, match="holds 4 microbatches, but -m 8"):
        load_schedule(str(path), 2, 8)
    with pytest.raises(CliError, match="needs --ranks and --microbatches"):
        load_schedule("1f1b", 2, None)
    with pytest.raises(CliError, match="unknown schedule 'zb'"):
        load_schedule("zb", 2, 4)


def test_load_timeline_reads_what_to_dict_writes(tmp_path: Path) -> None:
    from _viz_cases import as_measured, simulated

    timeline = as_measured(simulated("zbv")[1], 0.01, origin=3.0)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(timeline.to_dict()))
    back = load_timeline(str(path))
    assert isinstance(back, Timeline) and back == timeline
    with pytest.raises(CliError, match="is a directory"):
        load_timeline(str(tmp_path))
    with pytest.raises(CliError, match="cannot read"):
        load_timeline(str(tmp_path / "missing.json"))
