"""Tests for duplexpipe.cli.checkpoint_cmds: `duplexpipe checkpoint verify` exits 0 for an intact checkpoint, 1 naming
the damaged file, 2 for a path that is no checkpoint; a save folder means the checkpoint its `latest` names, or
every step with --all; --help has the description and the exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _checkpoint_faults import DEEP_KEY, flip, remanifest, small_checkpoint

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


def test_metadata_nested_a_million_deep_is_refused_and_never_crashes(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    save = tmp_path / "ckpt"
    step = save / "step-000010"
    small_checkpoint(step)
    publish(str(save), "step-000010")
    recorded = json.loads((step / "manifest.json").read_text())["files"][".metadata"]["size"]
    (step / ".metadata").write_bytes(DEEP_KEY)
    code, out, _ = _run(capsys, str(save))  # not the file the manifest recorded: never unpickled
    assert code == 1 and out == (f"DAMAGED {step}: .metadata has {len(DEEP_KEY)} bytes, the manifest recorded "
                                 f"{recorded} (truncated or changed)\n"), out
    remanifest(step)  # as whoever crafted it would
    refused = (f"checkpoint {step}: its .metadata nests objects more than 64 deep, which checkpoint metadata never "
               "does; refused without loading it (a crafted file could crash the process)")
    code, out, _ = _run(capsys, str(save))
    assert code == 1 and out == f"DAMAGED {step}: {refused}\n", out
    code = main(["train", "--ranks", "2", "--steps", "20", "--save", str(save)])  # resume auto: no older one
    err = capsys.readouterr().err
    assert code == 2 and err == f"duplexpipe: error: {refused}\n", err
    code = main(["train", "--ranks", "2", "--steps", "20", "--resume", str(step)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"duplexpipe: error: {refused}\n", err


def test_not_a_checkpoint_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path, needle in ((tmp_path / "nowhere", "is not a folder"), (tmp_path, "is not a checkpoint folder")):
        code, out, err = _run(capsys, str(path))
        assert code == 2 and err.count("\n") == 1 and needle in err and not out, (out, err)


def test_help_describes_the_check_and_its_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["checkpoint", "verify", "--help"])
    out = capsys.readouterr().out
    assert "without loading it" in out and "exit codes: 0 intact" in out and "1 damaged" in out and "2 bad input" in out


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_verify_refuses_what_resume_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stage-keyed format-1 checkpoint and one without the trainer's entries had every file intact: verify said OK
    while resume refused them."""
    import torch

    from duplexpipe.train.checkpoint.folder import save_state

    old, foreign = tmp_path / "old" / "step-000010", tmp_path / "foreign" / "step-000010"
    save_state({"model": {"stage0.w": torch.ones(2)}, "trainer": {"calls": 1}}, str(old))
    save_state({"model": {"w": torch.ones(2)}}, str(foreign))
    stage_keyed = f"checkpoint {old}: it has the stage-keyed format 1 of earlier duplexpipe versions"
    for step, line in ((old, stage_keyed[len(f"checkpoint {old}: "):]),
                       (foreign, "it lacks the trainer entries trainer.format, trainer.layout, ")):
        code, out, _ = _run(capsys, str(step))
        assert code == 1 and out.startswith(f"DAMAGED {step}: {line}") and out.count("\n") == 1, out
    code = main(["train", "--ranks", "2", "--steps", "20", "--resume", str(old)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"duplexpipe: error: {stage_keyed}") and err.count("\n") == 1, err
