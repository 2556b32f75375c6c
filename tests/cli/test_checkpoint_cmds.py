"""Tests for duplexpipe.cli.checkpoint_cmds: `duplexpipe checkpoint verify` exits 0 for an intact checkpoint, 1 naming
the damaged file, 2 for a path that is no checkpoint; a save folder means the checkpoint its `latest` names, or
every step with --all; --help has the description and the exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
from _checkpoint_faults import flip, small_checkpoint

from duplexpipe.cli import main
from duplexpipe.launch.checkpoints import publish


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["checkpoint", "verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_an_intact_and_a_damaged_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save = tmp_path / "ckpt"
    small_checkpoint(save / "step-000010")
    small_checkpoint(save / "step-000020")
    publish(str(save), "step-000020")
    code, out, _ = _run(capsys, str(save))
    assert code == 0 and out.startswith(f"OK {save / 'step-000020'}: 2 files") and out.count("\n") == 1, out
    flip(save / "step-000010" / "__0_0.distcp")
    code, out, _ = _run(capsys, str(save), "--all")
    lines = out.splitlines()
    assert code == 1 and len(lines) == 2, out
    assert lines[0] == (f"DAMAGED {save / 'step-000010'}: __0_0.distcp differs from the checksum the manifest "
                        "recorded (changed or damaged since it was saved)")
    assert lines[1].startswith(f"OK {save / 'step-000020'}")


def test_not_a_checkpoint_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path, needle in ((tmp_path / "nowhere", "is not a folder"), (tmp_path, "is not a checkpoint folder")):
        code, out, err = _run(capsys, str(path))
        assert code == 2 and err.count("\n") == 1 and needle in err and not out, (out, err)


def test_help_describes_the_check_and_its_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["checkpoint", "verify", "--help"])
    out = capsys.readouterr().out
    assert "without loading it" in out and "exit codes: 0 intact" in out and "1 damaged" in out and "2 bad input" in out
