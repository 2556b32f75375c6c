"""Tests for duplexpipe.cli.train_cmd: `duplexpipe train --schedule FILE` trains a hand-written schedule; a file that
deadlocks, disagrees with the flags or gets generator options is refused in one line before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplexpipe.cli import main as cli_main
from duplexpipe.launch import train_loop

SMALL = ["--task-option", "n_layer=2", "--task-option", "d_model=16", "--task-option", "n_head=2", "--task-option",
         "block_size=16", "--batch-size", "4", "--log-every", "0", "--no-tensorboard"]


def _file(path: Path, rank0: str, rank1: str) -> str:
    """A two-rank, two-microbatch schedule written by hand, as a user would."""
    path.write_text('{"format": "duplexpipe-schedule", "version": 1, "name": "mine", "num_ranks": 2, '
                    '"num_microbatches": 2, "stages": [{"rank": 0, "group": 0}, {"rank": 1, "group": 1}], '
                    f'"actions": [{rank0}, {rank1}]}}\n', encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("rank0, rank1, extra, needle", [
    ('["0F0", "0B0", "0F1", "0B1"]', '["1F1", "1B1", "1F0", "1B0"]', [],
     "cannot run: deadlock in 'mine': rank 0 blocked at 0B0 waiting for 1B0 on rank 1; rank 1 blocked at 1F1 "
     "waiting for 0F1 on rank 0; cycle: rank 0: 0B0 -> 0F1 => rank 1"),
    ('["0F0", "0F1", "0B1", "0B0"]', '["1F0", "1F1", "1B1", "1B0"]', ["--ranks", "4"],
     "--ranks 4, but the schedule file mine.json is for 2 ranks; leave --ranks out"),
    ('["0F0", "0F1", "0B1", "0B0"]', '["1F0", "1F1", "1B1", "1B0"]', ["--opt", "chunks=2"],
     "--opt applies to built-in schedules; mine.json is a file"),
    ('["0F0", "0F1", "0B1"]', '["1F0", "1F1", "1B1", "1B0"]', [], "cannot run: "),
])
def test_a_bad_schedule_file_is_one_line_before_any_process(rank0: str, rank1: str, extra: list[str], needle: str,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_loop, "run_training", lambda *_: pytest.fail("a process was started"))
    path = _file(tmp_path / "mine.json", rank0, rank1)
    assert cli_main(["train", "--schedule", Path(path).name, *extra, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexpipe: error: ") and needle in err and err.count("\n") == 1, err


@pytest.mark.timeout(180)
def test_train_runs_a_hand_written_schedule_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--schedule mine.json` was "unknown schedule"; the file states 2 ranks and 2 microbatches."""
    monkeypatch.chdir(tmp_path)
    path = _file(tmp_path / "mine.json", '["0F0", "0F1", "0B1", "0B0"]', '["1F0", "1F1", "1B1", "1B0"]')
    assert cli_main(["train", "--schedule", "mine.json", "--steps", "2", "--out-dir", "run", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "mine.json on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps" in out, out
    assert "tokens/s" in out, out
    assert "0B1" in (tmp_path / "run" / "timeline.json").read_text() and Path(path).is_file()


def test_a_schedule_refusing_the_flags_is_told_before_torch_is_imported() -> None:
    """`duplexpipe train --schedule dualpipe --microbatches 3`: exit 2 and the schedule's one line, from a process
    that never imported torch (it takes seconds to import)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom duplexpipe.cli.main import main\n"
             "code = main(['train', '--schedule', 'dualpipe', '--ranks', '2', '--microbatches', '3'])\n"
             "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\nsys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "duplexpipe: error: dualpipe needs an even number of microbatches, got num_microbatches=3\n"
    assert done.stdout == "torch not imported\n"
