"""Tests for duplexpipe.launch.rank_output: the ranks' standard error is relayed without torch's native log records and
frames (held back in the file), and a job whose rank was killed says so first, in two lines, naming the file."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from _crash_task import NATIVE_NOISE

from duplexpipe.cli import main as cli_main
from duplexpipe.launch.rank_output import RankOutput

TASK = str(Path(__file__).resolve().parents[1] / "_crash_task.py") + ":crash_task"


def test_native_lines_are_held_back_and_the_rest_relayed_as_it_comes() -> None:
    output = RankOutput()
    try:
        with open(output.path, "a", encoding="utf-8") as fh:
            fh.write("a warning from rank 1\n" + NATIVE_NOISE + "[rank0]:W1207 12:00:00.000000 42 torch/x.py:1] a "
                     "Python log line\nno newline yet")
        shown = io.StringIO()
        output.relay(shown)
        assert shown.getvalue() == "a warning from rank 1\n[rank0]:W1207 12:00:00.000000 42 torch/x.py:1] a Python " \
                                   "log line\n"
        assert output.held == 31
        output.relay(shown, final=True)
        assert shown.getvalue().endswith("log line\nno newline yet\n")
        assert output.close(keep=False) == output.path and Path(output.path).is_file()  # it holds what was not shown
    finally:
        Path(output.path).unlink()
    quiet = RankOutput()
    assert quiet.close(keep=False) is None and not Path(quiet.path).exists()


@pytest.mark.timeout(180)
def test_a_killed_rank_is_named_first_and_its_peers_noise_kept_in_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["train", "--task", TASK, "--task-option", "kill_step=1", "--task-option", "kill_rank=0",
                     "--task-option", "noise_rank=1", "--task-option", "n_layer=2", "--task-option", "d_model=16",
                     "--task-option", "n_head=2", "--task-option", "block_size=8", "--schedule", "1f1b", "--ranks", "2",
                     "--microbatches", "2", "--batch-size", "4", "--steps", "3", "--log-every", "0",
                     "--no-tensorboard", "--timeout", "60"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 1 and len(lines) == 2, lines
    assert lines[0] == ("duplexpipe: error: rank 0 was killed by signal 9 (SIGKILL: out of memory, or killed from "
                        "outside) without reporting a result"), lines
    prefix = "duplexpipe: the ranks' whole output (torch's native log included) is in "
    assert lines[1].startswith(prefix), lines
    kept = Path(lines[1][len(prefix):])
    try:
        assert NATIVE_NOISE in kept.read_text(encoding="utf-8")
    finally:
        kept.unlink()
