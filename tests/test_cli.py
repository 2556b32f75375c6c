"""Tests of the `duplexpipe` command: every command, and every bad-input case exits 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from duplexpipe.cli import main
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Op, Schedule, StageInfo, parse_action, save_json


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schedules_lists_every_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schedules")
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(registry.names())
    assert all(len(line.split()) > 2 for line in lines), "each schedule needs a description"


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
    for key in ("schedule", "ranks", "microbatches", "makespan", "bubble_ratio", "per_rank"):
        assert key in data
    assert data["ranks"] == 4 and len(data["per_rank"]) == 4
    # 1F1B, F=1 B=2: makespan (M + P - 1)(F + B) = 33, idle (P-1)(F+B) = 9 on every rank
    assert data["makespan"] == pytest.approx(33)
    assert [r["idle"] for r in data["per_rank"]] == pytest.approx([9] * 4)
    assert [r["peak_activations"] for r in data["per_rank"]] == [4, 3, 2, 1]


def test_simulate_text_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "gpipe", "-p", "2", "-m", "4", "--cost", "F=2,B=4,W=1")
    assert code == 0 and "makespan=30" in out


def test_compare_covers_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--json")
    assert code == 0
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    assert set(rows) == set(registry.names())
    assert rows["dualpipe"]["params_per_rank"] == 2.0 and rows["1f1b"]["params_per_rank"] == 1.0
    assert rows["zb-h1"]["bubble_ratio"] < rows["1f1b"]["bubble_ratio"]
    code, out, _ = run(capsys, "compare", "-p", "3", "-m", "6")
    assert code == 0 and "dualpipe" in out and "skipped" in out


def test_export_and_verify_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for fmt, ext in (("json", "json"), ("torch-csv", "csv")):
        path = tmp_path / f"s.{ext}"
        code, _, _ = run(capsys, "export", "zbv", "-p", "4", "-m", "8", "--format", fmt, "-o", str(path))
        assert code == 0 and path.exists()
        code, out, _ = run(capsys, "verify", str(path))
        assert code == 0 and out.startswith("OK")
    code, out, _ = run(capsys, "verify", "dualpipev", "-p", "4", "-m", "8")
    assert code == 0


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


BAD_INPUTS = [
    ("unknown schedule", ["simulate", "nosuch", "-p", "4", "-m", "8"], "nosuch"),
    ("odd ranks for dualpipe", ["simulate", "dualpipe", "-p", "3", "-m", "8"], "3"),
    ("too few microbatches", ["verify", "dualpipe", "-p", "4", "-m", "2"], "2"),
    ("zero ranks", ["show", "1f1b", "-p", "0", "-m", "8"], "0"),
    ("non-integer", ["compare", "-p", "four", "-m", "8"], "four"),
    ("missing P/M", ["simulate", "1f1b"], "--ranks"),
    ("bad cost key", ["simulate", "1f1b", "-p", "2", "-m", "2", "--cost", "Q=1"], "Q"),
    ("bad cost value", ["simulate", "1f1b", "-p", "2", "-m", "2", "--cost", "F=abc"], "abc"),
    ("missing file", ["verify", "/nonexistent/s.json"], "/nonexistent/s.json"),
    ("bad format", ["export", "1f1b", "-p", "2", "-m", "2", "--format", "xml", "-o", "x"], "xml"),
    ("no command", [], "COMMAND"),
]


@pytest.mark.parametrize("label,argv,needle", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(label: str, argv: list[str], needle: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2, label
    assert err.count("\n") == 1 and err.startswith("duplexpipe: error:")
    assert needle in err
    assert "Traceback" not in err + out


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ('{"format": "duplexpipe-schedule", "version": 1, "name": "x", "num_ranks": 1, "num_microbatches": 1, '
     '"stages": [{"rank": 0, "group": 0}], "actions": [["0F0", "0Q0"]]}', "0Q0"),
])
def test_malformed_json_files(tmp_path: Path, content: str, needle: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, _, err = run(capsys, "verify", str(path))
    assert code == 2 and needle in err and err.count("\n") == 1


def test_malformed_csv_names_line_and_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1X0\n")
    code, _, err = run(capsys, "verify", str(path))
    assert code == 2 and "line 2" in err and "1X0" in err


def test_console_script_help_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "duplexpipe.cli", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for command in ("schedules", "show", "verify", "simulate", "compare", "export", "train"):
        assert command in proc.stdout


def test_export_converts_a_file_between_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = tmp_path / "s.json", tmp_path / "s.csv"
    assert run(capsys, "export", "dualpipe", "-p", "4", "-m", "8", "--format", "json", "-o", str(src))[0] == 0
    assert run(capsys, "export", str(src), "--format", "torch-csv", "-o", str(dst))[0] == 0
    rows = dst.read_text().splitlines()
    assert len(rows) == 4 and rows[0].split(",")[0] == "0F0"
    code, _, err = run(capsys, "export", "1f1b", "--format", "json", "-o", str(dst))
    assert code == 2 and "--ranks" in err
