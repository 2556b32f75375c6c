"""Tests for duplexpipe.pipeline.train: task loading, a full `duplexpipe train` run (2 pp x 2 dp)."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from duplexpipe.pipeline.train import (
    DEFAULT_TASK,
    ProgressLine,
    TrainConfig,
    add_train_arguments,
    config_from_args,
    load_task,
    parse_task_options,
    train_main,
)
from duplexpipe.schedules.timeline import Timeline

ROOT = Path(__file__).resolve().parents[1]


def test_load_task_resolves_files_and_modules() -> None:
    assert DEFAULT_TASK.endswith("examples/gpt.py:gpt_task")
    task_fn = load_task(DEFAULT_TASK)
    assert task_fn.__name__ == "gpt_task"
    assert load_task("json:dumps") is json.dumps
    with pytest.raises(ValueError, match="must look like"):
        load_task("no_colon")
    with pytest.raises(ValueError, match="does not exist"):
        load_task("missing_file.py:f")
    with pytest.raises(TypeError, match="has no function 'nope'"):
        load_task("json:nope")


def test_parse_task_options() -> None:
    assert parse_task_options(["n=3", "lr=1e-3", "name=abc"]) == {"n": 3, "lr": 1e-3, "name": "abc"}
    with pytest.raises(ValueError, match="'3' must look like KEY=VALUE"):
        parse_task_options(["3"])


def test_parts_needed_and_progress_line() -> None:
    assert TrainConfig(schedule="dualpipe", ranks=4).parts_needed() == 4
    assert TrainConfig(schedule="dualpipev", ranks=4).parts_needed() == 8
    out = io.StringIO()
    bar = ProgressLine(4, "tokens", out)
    bar.update(2, 1.5, 1234.0)
    bar.close()
    assert out.getvalue().startswith("\r[############............] step 2/4  loss 1.5000  1,234 tokens/s")
    assert out.getvalue().endswith("\n")


@pytest.mark.timeout(240)
def test_train_main_runs_pipeline_by_data_parallel(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    small = ["n_layer=2", "d_model=16", "n_head=2", "block_size=16", "batch_size=8"]
    args = parser.parse_args([
        "--schedule", "1f1b", "--ranks", "2", "--dp", "2", "--microbatches", "2", "--steps", "4",
        "--balance", "time", "--out-dir", str(tmp_path), "--no-progress",
        *[arg for opt in small for arg in ("--task-option", opt)],
    ])
    config = config_from_args(args)
    assert (config.dp, config.balance, config.progress) == (2, "time", False)
    assert config.task_options == {
        "n_layer": 2, "d_model": 16, "n_head": 2, "block_size": 16, "batch_size": 8}
    out = io.StringIO()
    assert train_main(args, out) == 0
    text = out.getvalue()
    assert "1f1b on 2 ranks x 2 dp, 4 steps" in text and "partition (time" in text
    summary = json.loads((tmp_path / "losses.json").read_text())
    assert len(summary["losses"]) == 4 and summary["items_per_s"] > 0
    timeline = Timeline.from_dict(json.loads((tmp_path / "timeline.json").read_text()))
    assert timeline.num_ranks == 2 and {e.rank for e in timeline.events} == {0, 1}
    assert len(timeline.events) == 2 * 2 * 2  # 2 ranks x 2 microbatches x (F, B)
    assert "est. time" in (tmp_path / "partition.txt").read_text()
