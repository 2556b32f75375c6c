"""Tests for duplexpipe.launch.checkpoints: `latest` names only complete checkpoints, --resume auto picks it (or a
fresh start), --keep deletes older ones and never a newer leftover."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplexpipe.launch.checkpoints import (
    LATEST,
    checkpoint_to_load,
    discard_partial,
    latest_checkpoint,
    publish,
    resume_from,
    step_folders,
    step_name,
)


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / step_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"data")
    if complete:
        (path / ".metadata").write_bytes(b"meta")
    return path


def test_resume_auto_takes_the_latest_complete_checkpoint_or_starts_fresh(tmp_path: Path) -> None:
    assert resume_from(None, None) is None and resume_from("none", str(tmp_path)) is None
    assert resume_from(None, str(tmp_path / "new")) is None, "--save of a new run: a fresh start"
    _checkpoint(tmp_path, 3)
    _checkpoint(tmp_path, 6, complete=False)  # a half-written checkpoint, never named latest
    assert resume_from(None, str(tmp_path)) is None, "no latest yet: nothing complete was published"
    publish(str(tmp_path), step_name(3))
    assert resume_from(None, str(tmp_path)) == str(tmp_path / "step-000003")
    assert resume_from("auto", str(tmp_path)) == str(tmp_path / "step-000003")
    assert checkpoint_to_load(str(tmp_path)) == str(tmp_path / "step-000003")
    assert checkpoint_to_load(str(tmp_path / "step-000003")) == str(tmp_path / "step-000003")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        resume_from(str(tmp_path / "step-000006"), None)
    (tmp_path / LATEST).write_text("step-000006\n")
    with pytest.raises(ValueError, match="names 'step-000006', which is not a complete checkpoint"):
        latest_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="give --save"):
        resume_from("auto", None)


def test_publish_replaces_latest_atomically_and_keeps_the_newest(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 1, complete=False)  # an old leftover
    _checkpoint(tmp_path, 12, complete=False)  # a crashed attempt's, newer than latest
    publish(str(tmp_path), step_name(9), keep=2)
    assert (tmp_path / LATEST).read_text() == "step-000009\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-000006", "step-000009", "step-000012"]
    publish(str(tmp_path), step_name(9), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-000009", "step-000012"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "no temporary file left"


def test_a_huge_latest_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 3)
    with open(tmp_path / LATEST, "wb") as fh:
        fh.truncate(2**30)  # sparse
    with pytest.raises(ValueError, match="over the 4 KiB limit for a 'latest' file"):
        resume_from(None, str(tmp_path))


def test_a_failed_saves_folder_goes_unless_latest_names_it(tmp_path: Path) -> None:
    for step in (1, 2):
        _checkpoint(tmp_path, step)
    publish(str(tmp_path), step_name(1))
    discard_partial(str(tmp_path), step_name(2))
    discard_partial(str(tmp_path), step_name(1))
    assert [p.name for p in step_folders(tmp_path)] == [step_name(1)]
