"""Tests for duplexpipe.launch.checks: every configuration error of `duplexpipe train` is found before any process
starts (exit 2, one line); the ZeRO / compression / optimizer combinations through check_training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from duplexpipe.cli import main as cli_main
from duplexpipe.dp_options.compression import DGCOptions
from duplexpipe.dp_options.zero import ZeroOptions
from duplexpipe.launch import checks, train_loop
from duplexpipe.launch.train_config import TrainConfig
from duplexpipe.train.pipeline_config import PipelineConfig


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the ranks fails the test: each error must be found before."""
    def spawned(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("duplexpipe train started processes")

    monkeypatch.setattr(train_loop, "run", spawned)


def _task_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return f"{path}:task"


@pytest.mark.parametrize("case, message", [
    ("zbv-too-few-layers", "has 4 layers, but schedule 'zbv' on 4 ranks runs 8 model parts"),
    ("layers-option", "has 2 layers, but schedule 'dualpipe' on 4 ranks runs 4 model parts"),
    ("bad-task-option", "with options {'n_head': 3}: d_model 64 is not a multiple of n_head 3"),
    ("unknown-task-option", "unexpected keyword argument 'width'"),
    ("syntax-error", "failed (line 2): SyntaxError"),
    ("import-error", "failed: ModuleNotFoundError: No module named 'not_installed_anywhere'"),
    ("no-function", "has no function 'task'"),
    ("microbatches", "microbatches"),
    ("tp-heads", "'layer0.attn' (CausalSelfAttention) has n_head=4, not divisible by the TP degree 3"),
    ("sp-without-tp", "sequence_parallel shards the sequence over the tensor-parallel ranks: it needs tp > 1"),
    ("tp-without-plan", "--tp 2: task"),
])
def test_configuration_errors_exit_2_with_one_line_before_any_process(
        case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = {
        "zbv-too-few-layers": ["--schedule", "zbv", "--ranks", "4", "--microbatches", "3"],
        "layers-option": ["--task-option", "n_layer=2"],
        "bad-task-option": ["--task-option", "n_head=3"],
        "unknown-task-option": ["--task-option", "width=3"],
        "syntax-error": ["--task", _task_file(tmp_path, "broken", "import torch\ndef task(:\n")],
        "import-error": ["--task", _task_file(tmp_path, "missing_dep", "import not_installed_anywhere\n")],
        "no-function": ["--task", _task_file(tmp_path, "other", "def other():\n    pass\n")],
        "microbatches": ["--schedule", "zbv", "--ranks", "4", "--microbatches", "0"],
        "tp-heads": ["--tp", "3"],
        "sp-without-tp": ["--sequence-parallel"],
        "tp-without-plan": ["--tp", "2", "--task", _task_file(
            tmp_path, "plainer", "from duplexpipe.launch.tasks.gpt import gpt_task\n\n\ndef task():\n"
                                 "    made = gpt_task()\n    made.tp_plan = None\n    return made\n")],
    }[case]
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexpipe: error:") and message in err and err.count("\n") == 1, err


def _with(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> None:
    """check_training sees the PipelineConfig a run with these fields would train with (the flags for
    ZeRO and gradient compression feed the same function)."""
    def made(config: TrainConfig) -> PipelineConfig:
        return PipelineConfig(config.schedule, config.microbatches, **fields)

    monkeypatch.setattr(checks, "pipeline_config", made)


def test_dgc_with_an_optimizer_that_has_momentum_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, grad_compression=DGCOptions())
    with pytest.raises(ValueError, match="'dgc' applies momentum 0.9 itself"):
        checks.check_training(TrainConfig(optimizer="sgd", momentum=0.9, dp=2, ranks=2))
    checks.check_training(TrainConfig(optimizer="sgd", momentum=0.0, dp=2, ranks=2))  # no momentum: fine


def test_zero_with_an_unsupported_combination_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, zero_stage=2, grad_compression="powersgd")
    with pytest.raises(ValueError, match="'powersgd' cannot be combined with ZeRO"):
        checks.check_training(TrainConfig(dp=2, ranks=2))
    _with(monkeypatch, zero_stage=2, zero=ZeroOptions(hpz_ranks=2))
    with pytest.raises(ValueError, match="needs a schedule without split backward"):
        checks.check_training(TrainConfig(schedule="zb-h1", dp=4, ranks=2))


def test_a_good_configuration_passes_and_the_task_is_built_on_the_meta_device() -> None:
    checks.check_training(TrainConfig())
    with pytest.raises(ValueError, match="has 4 layers, but schedule 'dualpipe' on 8 ranks runs 8"):
        checks.check_training(TrainConfig(ranks=8, microbatches=16))
    task = checks._built(TrainConfig())
    assert all(p.is_meta for layer in task.layers for p in layer.parameters())
