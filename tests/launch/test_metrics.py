"""Tests for duplexpipe.launch.metrics: JSONL rows, TensorBoard through a fake writer, progress output; a compiled
`duplexpipe train` run with an evaluation, Weights & Biases offline and a torch.profiler trace, as the user sees it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from duplexpipe.launch.metrics import (
    TENSORBOARD_MISSING,
    MetricsLog,
    log_line,
    plain_every,
    progress_bar,
    read_metrics,
    tensorboard_writer,
)


class FakeWriter:
    """Records what a SummaryWriter would write."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.scalars: list[tuple[str, Any, int]] = []
        self.closed = False

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_jsonl_one_row_per_step_and_scalars_to_the_writer(tmp_path: Path) -> None:
    writers: list[FakeWriter] = []

    def factory(folder: str) -> FakeWriter:
        writers.append(FakeWriter(folder))
        return writers[-1]

    log = MetricsLog(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb", writer_factory=factory)
    log.write(1, {"loss": 2.5, "lr": 1e-3, "grad_norm": None, "items_per_s": 100.0, "bubble": 0.25})
    log.write(2, {"loss": math.nan, "lr": 1e-3, "grad_norm": 0.5, "items_per_s": 110.0, "bubble": 0.2})
    log.close()
    rows = read_metrics(tmp_path / "m.jsonl")
    assert rows[0] == {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "items_per_s": 100.0, "bubble": 0.25}
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] == 0.5  # NaN is not JSON: null
    (writer,) = writers
    assert writer.folder == str(tmp_path / "tb") and writer.closed
    assert ("train/loss", 2.5, 1) in writer.scalars and ("train/grad_norm", 0.5, 2) in writer.scalars
    assert not any(tag == "train/grad_norm" and step == 1 for tag, _, step in writer.scalars)
    assert {tag for tag, _, _ in writer.scalars} == {f"train/{k}" for k in
                                                      ("loss", "lr", "grad_norm", "items_per_s", "bubble")}
    resumed = MetricsLog(tmp_path / "m.jsonl", append=True)
    resumed.write(3, {"loss": 2.0})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3]


def test_without_tensorboard_installed_there_are_no_scalars(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    assert tensorboard_writer() is None
    log = MetricsLog(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb", writer_factory=tensorboard_writer())
    log.write(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "tb").exists() and len(read_metrics(tmp_path / "m.jsonl")) == 1


@pytest.mark.timeout(300)
def test_a_compiled_run_says_what_compiles_and_writes_wandb_offline_and_a_trace(tmp_path: Path) -> None:
    """`duplexpipe train --compile backend=eager --eval-every 2 --profile-steps 2:2 --wandb mode=offline --out-dir
    out`: the first step's compile time, the first evaluation's recompilation announced and explained, TensorBoard's
    absence said once, a wandb run written offline with the scalars, and a Chrome trace of step 2."""
    pytest.importorskip("wandb")
    env = {**os.environ, **{name: str(tmp_path / "wandb-home") for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                                                            "WANDB_DATA_DIR")}}
    argv = ["train", "--schedule", "1f1b", "--ranks", "1", "--microbatches", "1", "--batch-size", "2", "--steps", "2",
            "--log-every", "1", "--task-option", "n_layer=2", "--task-option", "d_model=16", "--task-option",
            "n_head=2", "--task-option", "block_size=16", "--compile", "backend=eager", "--eval-every", "2",
            "--eval-batches", "1", "--profile-steps", "2:2", "--wandb", "mode=offline", "--out-dir", "out"]
    done = subprocess.run([sys.executable, "-m", "duplexpipe.cli", *argv], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "compiling 2 modules with eager on the first step" in lines, lines
    assert any(line.startswith("step 1: compiled ") and "; the step took " in line for line in lines), lines
    at = next(i for i, line in enumerate(lines) if line.startswith("step 2 evaluate: the first evaluation runs the "
                                                                     "compiled blocks without gradients"))
    assert lines[at + 1].startswith("step 2 evaluate recompiled ") and "grad_mode" in lines[at + 1], lines[at + 1]
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    assert lines.count(TENSORBOARD_MISSING) == (0 if tensorboard else 1)
    assert "torch.profiler trace of steps 2:2: out/profile/rank-0.json (one per rank)" in lines
    trace = json.loads((tmp_path / "out" / "profile" / "rank-0.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    [run] = (tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb")
    assert all(tag in run.read_bytes() for tag in (b"train/loss", b"train/lr", b"eval/loss"))


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_file_or_pipe() -> None:
    """--progress redrew one line with carriage returns whatever the output was, so a log file held one
    ever-growing line."""
    assert progress_bar(4, 0, "tokens", io.StringIO()) is None  # a file or pipe: the caller prints plain lines
    assert plain_every(0, 60, progress=True) == 3 and plain_every(10, 60, progress=True) == 10
    assert plain_every(0, 60, progress=False) == 0 and plain_every(0, 5, progress=True) == 1
    term = _Terminal()
    bar = progress_bar(4, 1, "tokens", term)
    assert bar is not None
    bar.update(2, 1.5, 0.0)
    bar.update(4, 1.25, 1234.0)
    bar.close()
    text = term.getvalue()
    assert "\r" in text and "4/4" in text and "loss 1.2500" in text and "1,234 tokens/s" in text


def test_log_line() -> None:
    line = log_line(10, 60, {"loss": 2.30123, "lr": 3e-3, "grad_norm": 0.8123, "items_per_s": 12345.6}, "tokens")
    assert line == "step 10/60  loss 2.3012  lr 3.00e-03  grad 0.812  12,346 tokens/s"
    assert log_line(1, 2, {"loss": 1.0, "lr": 1.0, "grad_norm": None, "items_per_s": 0.0}, "x") == \
        "step 1/2  loss 1.0000  lr 1.00e+00"


def test_memory_summary_is_one_line_per_rank_and_the_largest() -> None:
    from duplexpipe.launch.metrics import memory_summary
    from duplexpipe.runtime.memory import MemoryReport

    reports = [MemoryReport(r, 1024, 1024, 2048, 4096 // (r + 1), 0, 9000 - r) for r in range(2)]
    lines = memory_summary(reports)
    assert len(lines) == 4 and lines[1].startswith("  rank 0: peak 8.8 KiB (params 1.0 KiB")
    assert lines[-1] == "  largest: rank 0, 9,000 bytes"
    assert memory_summary([]) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_names_the_metrics_file() -> None:
    """/dev/full: every write fails with "No space left on device", as a full disk does, and names no file."""
    log = MetricsLog("/dev/full", append=True)
    with pytest.raises(OSError, match=r"No space left on device: '/dev/full'"):
        log.write(1, {"loss": 1.0})
    with contextlib.suppress(OSError):
        log.close()
