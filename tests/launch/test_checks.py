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
from duplexpipe.launch.train_config import CheckpointConfig, OptimizerConfig, TrainConfig
from duplexpipe.train.pipeline_config import DataParallelConfig, PipelineConfig


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


def _pipeline(schedule: str = "dualpipe", microbatches: int = 8, **data_parallel: Any) -> PipelineConfig:
    """The PipelineConfig of a run with these data-parallel settings (as the flags for ZeRO and gradient compression
    would set them)."""
    return PipelineConfig(schedule, microbatches, data_parallel=DataParallelConfig(**data_parallel))


def test_dgc_with_an_optimizer_that_has_momentum_is_refused() -> None:
    dgc = _pipeline(grad_compression=DGCOptions())
    with pytest.raises(ValueError, match="'dgc' applies momentum 0.9 itself"):
        checks.check_training(TrainConfig(optimizer=OptimizerConfig("sgd", momentum=0.9), dp=2, ranks=2, pipeline=dgc))
    checks.check_training(TrainConfig(optimizer=OptimizerConfig("sgd", momentum=0.0), dp=2, ranks=2,
                                      pipeline=dgc))  # no momentum: fine


def test_zero_with_an_unsupported_combination_is_refused() -> None:
    with pytest.raises(ValueError, match="'powersgd' cannot be combined with ZeRO"):  # found by the config itself
        TrainConfig(dp=2, ranks=2, pipeline=_pipeline(zero_stage=2, grad_compression="powersgd"))
    hpz = _pipeline("zb-h1", zero_stage=2, zero=ZeroOptions(hpz_ranks=2))
    with pytest.raises(ValueError, match="needs a schedule without split backward"):
        checks.check_training(TrainConfig(dp=4, ranks=2, pipeline=hpz))
    hpz3 = _pipeline("zb-h1", zero_stage=3, zero=ZeroOptions(hpz_ranks=2))  # ZeRO-3 reshards after each W
    checks.check_training(TrainConfig(dp=4, ranks=2, pipeline=hpz3))
    with pytest.raises(ValueError, match="hpz_ranks=4 must divide the data-parallel size 4 and be smaller"):
        checks.check_training(TrainConfig(dp=4, ranks=2, pipeline=_pipeline(zero_stage=3,
                                                                          zero=ZeroOptions(hpz_ranks=4))))


def test_saving_zero_with_experts_is_refused_only_where_they_stay_whole(tmp_path: Path) -> None:
    """ZeRO-2/3 with 1 < ep < dp shard the experts over their replicas (FSDP's DTensors, which checkpoints take);
    ZeRO-1, ep == dp and ep 1 leave them whole, whose ZeRO checkpoints are refused."""
    def config(zero: int, ep: int, dp: int) -> TrainConfig:
        return TrainConfig(dp=dp, ep=ep, ranks=1, batch_size=64, pipeline=_pipeline("1f1b", 2, zero_stage=zero),
                           checkpoint=CheckpointConfig(save=str(tmp_path / "ck")))
    task = checks._built(TrainConfig())
    for zero, ep, dp in ((2, 2, 4), (3, 2, 4), (3, 2, 8)):
        checks._check_supported(config(zero, ep, dp), task, has_experts=True)
    for zero, ep, dp in ((1, 2, 4), (2, 2, 2), (3, 4, 4), (3, 1, 2)):
        with pytest.raises(ValueError, match=f"--save with --zero-stage {zero} and MoE experts held whole"):
            checks._check_supported(config(zero, ep, dp), task, has_experts=True)


def test_a_good_configuration_passes_and_the_task_is_built_on_the_meta_device() -> None:
    checks.check_training(TrainConfig())
    with pytest.raises(ValueError, match="has 4 layers, but schedule 'dualpipe' on 8 ranks runs 8"):
        checks.check_training(TrainConfig(ranks=8, pipeline=PipelineConfig("dualpipe", 16)))
    task = checks._built(TrainConfig())
    assert all(p.is_meta for layer in task.layers for p in layer.parameters())


ANNOTATED = """
from torch import nn
from duplexpipe import TrainTask

def task(seed: int = 0) -> TrainTask:
    layers = [nn.Linear(4, 4) for _ in range(8)]
    return TrainTask(layers=layers, loss_fn=nn.functional.mse_loss, batch=lambda s, n: (None, None))

def unannotated(seed=0):
    return task(seed)

def bad_layers(seed: int = 0) -> TrainTask:
    return TrainTask(layers=5, loss_fn=nn.functional.mse_loss, batch=lambda s, n: (None, None))
"""


@pytest.mark.parametrize("case, message", [
    ("builtin", "task 'os:system': system is a builtin_function_or_method, not a task function"),
    ("class", "task 'subprocess:Popen': Popen is a type, not a task function"),
    ("file-builtin", "task 'os:system' comes from a config file|system is a builtin_function_or_method"),
    ("file-unannotated", "tasks.py does not define a function unannotated annotated '-> TrainTask'"),
    ("file-imports", "does not define a function task annotated '-> TrainTask'; a config file may only name"),
    ("bad-layers", "TrainTask.layers must be an nn.Sequential or a list of nn.Module, got int"),
    ("small-batch", "batch_size 4 is smaller than microbatches x dp = 8 x 1"),
    ("huge-config", "over the 1 MiB limit for a config file"),
])
def test_a_task_or_config_that_would_run_something_else_is_refused_before_it_runs(
        case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker"
    tasks = _task_file(tmp_path, "tasks", ANNOTATED).rsplit(":", 1)[0]
    config = tmp_path / "run.toml"
    argv = {
        "builtin": ["--task", "os:system", "--task-option", f"command='touch {marker}'"],
        "class": ["--task", "subprocess:Popen", "--task-option", f"args=['touch', '{marker}']"],
        "file-builtin": ["--config", str(config)],
        "file-unannotated": ["--config", str(config)],
        "file-imports": ["--config", str(config)],
        "bad-layers": ["--task", f"{tasks}:bad_layers"],
        "small-batch": ["--batch-size", "4", "--microbatches", "8"],
        "huge-config": ["--config", str(config)],
    }[case]
    if case == "file-builtin":
        config.write_text(f'task = "os:system"\n[task_options]\ncommand = "touch {marker}"\n')
    elif case == "file-unannotated":
        config.write_text(f'task = "{tasks}:unannotated"\n')
    elif case == "file-imports":  # a module that acts when imported: refused from its source, never imported
        side = _task_file(tmp_path, "side", f"open({str(marker)!r}, 'w').close()\ndef task():\n    pass\n")
        config.write_text(f'task = "{side}"\n')
    elif case == "huge-config":
        with open(config, "wb") as fh:
            fh.truncate(2 * 2**20)
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexpipe: error:") and err.count("\n") == 1, err
    assert any(m in err for m in message.split("|")), err
    assert not marker.exists(), "the task ran a command"


def test_a_config_naming_an_annotated_task_or_the_command_line_naming_any_function_passes(tmp_path: Path) -> None:
    tasks = _task_file(tmp_path, "tasks", ANNOTATED).rsplit(":", 1)[0]
    config = tmp_path / "run.toml"
    for argv in (["--config", str(config)], ["--task", f"{tasks}:unannotated"]):
        config.write_text(f'task = "{tasks}:task"\n')
        with pytest.raises(AssertionError, match="started processes"):  # every check passed
            cli_main(["train", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "4",
                      *argv])


def test_a_crafted_checkpoint_to_resume_from_is_refused_before_any_process(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from _checkpoint_faults import craft, small_checkpoint

    from duplexpipe.launch.checkpoints import publish

    save = tmp_path / "ckpt"
    small_checkpoint(save / "step-000005")
    publish(str(save), "step-000005")
    craft(save / "step-000005", tmp_path / "marker")
    assert cli_main(["train", "--save", str(save), "--steps", "10"]) == 2  # resumes from `latest` by default
    err = capsys.readouterr().err
    assert "its .metadata names posix.system, which checkpoint metadata never holds" in err and err.count("\n") == 1
    assert not (tmp_path / "marker").exists()
