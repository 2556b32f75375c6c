"""Faults in a `duplexpipe train` job with checkpoints, one after another in one save folder: a full disk during a
save and NaN gradients (exit 1) each end the run with one line naming the cause and lose nothing (the partial folder
is gone, `latest` names a complete checkpoint); a damaged newest checkpoint is passed over by `resume auto` with a
warning naming it (kept aside, exit 0). The job resumed afterwards ends bit-equal to an uninterrupted run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _checkpoint_faults import flip

from duplexpipe.cli import main as cli_main
from duplexpipe.launch.checkpoints import LATEST
from duplexpipe.train.checkpoint import read_checkpoint

TASKS = Path(__file__).resolve().parents[1] / "_bad_tasks.py"
RUN = ["--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "4", "--steps", "6",
       "--save-every", "2", "--log-every", "0", "--no-tensorboard", "--timeout", "60"]
"""PP=2, 1F1B, 6 steps, a checkpoint every 2."""


def _train(capsys: pytest.CaptureFixture[str], task: str, save: Path, *extra: str) -> tuple[int, str]:
    code = cli_main(["train", *RUN, "--task", f"{TASKS}:{task}", "--save", str(save), *extra])
    return code, capsys.readouterr().err


def _contents(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir())


def _assert_equal(got: Path, want: Path) -> None:
    a, b = read_checkpoint(str(got)), read_checkpoint(str(want))
    assert set(a) == set(b) and any(k.startswith("optim.state.") for k in a), sorted(set(a) ^ set(b))
    for key, value in b.items():
        assert torch.equal(a[key], value) if isinstance(value, torch.Tensor) else a[key] == value, (got, key)


@pytest.mark.timeout(300)
def test_each_fault_is_one_line_and_the_job_resumes_bit_equal(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    straight, save = tmp_path / "straight", tmp_path / "faulty"
    code, err = _train(capsys, "plain", straight)
    assert code == 0, err

    code, err = _train(capsys, "full_disk", save)  # the save of step 4 finds the disk full
    assert code == 1 and err.count("\n") == 1, err
    assert re.search(rf"CheckpointError: No space left on device while writing {save}/step-000004/__[01]_0\.distcp "
                     r"\(rank [01]", err), err
    assert _contents(save) == [LATEST, "step-000002"], _contents(save)  # the partial folder is gone, the lock released
    assert (save / LATEST).read_text().strip() == "step-000002"

    code, err = _train(capsys, "nan_batch", save)  # resumes from step 2, saves step 4, step 5 is NaN
    assert code == 1 and err.count("\n") == 1, err
    assert "NonFiniteGradientError: step 5: non-finite gradients, the first in stage 0, parameter " in err, err
    assert _contents(save) == [LATEST, "step-000002", "step-000004"], _contents(save)
    _assert_equal(save / "step-000004", straight / "step-000004")

    flip(save / "step-000004" / "__1_0.distcp")  # the newest checkpoint is damaged on disk
    damaged = (save / "step-000004" / "__1_0.distcp").read_bytes()
    code, err = _train(capsys, "plain", save)  # resume auto: from the one before it, naming the damaged one
    assert code == 0, err
    assert err.splitlines()[0] == (
        f"duplexpipe: warning: checkpoint {save}/step-000004 is incomplete or corrupt: __1_0.distcp differs from the "
        f"checksum the manifest recorded (changed or damaged since it was saved); load an older checkpoint (see "
        f"'duplexpipe checkpoint verify {save}/step-000004'); resuming from the older {save}/step-000002 instead (the "
        f"damaged one is kept as {save}/step-000004.damaged)"), err
    assert _contents(save) == [LATEST, "step-000002", "step-000004", "step-000004.damaged", "step-000006"]
    assert (save / "step-000004.damaged" / "__1_0.distcp").read_bytes() == damaged  # kept as it was
    for step in ("step-000004", "step-000006"):  # exactly as the run uninterrupted
        _assert_equal(save / step, straight / step)
