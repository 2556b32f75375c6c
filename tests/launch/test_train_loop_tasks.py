"""Tests for duplexpipe.launch.train_loop's task files, batches and progress output: a task file imports the
helpers beside it, a batch may be a tuple or dict of tensors (sliced per replica and microbatch, counted for
throughput), and --progress prints plain lines when the output is not a terminal."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from duplexpipe.cli.train_cmd import add_train_arguments, train_main
from duplexpipe.launch.batches import batch_rows, local_slice, rows_of
from duplexpipe.launch.train_task import load_task

HELPER = '''
import torch
from torch import nn

WIDTH = 8


class Scaled(nn.Module):
    """The embedding: takes the batch's inputs as one argument, as nn.Sequential hands them on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, inputs):
        x, scale = (inputs["x"], inputs["scale"]) if isinstance(inputs, dict) else inputs
        return self.lin(x) * scale
'''

TASK = '''
import torch
from torch import nn

from duplexpipe import TrainTask
from task_helpers import WIDTH, Scaled   # beside this file


def task(seed: int = 0, kind: str = "tensor"):
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]

    def batch(step, size):
        gen = torch.Generator().manual_seed(step)
        x, scale = torch.randn(size, WIDTH, generator=gen), torch.rand(size, 1, generator=gen)
        inputs = {"tensor": x, "tuple": (x, scale), "dict": {"x": x, "scale": scale}}[kind]
        return inputs, torch.sin(x)

    return TrainTask(layers=layers, loss_fn=nn.functional.mse_loss, batch=batch,
                     embedding=None if kind == "tensor" else Scaled())
'''


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own_task")
    (root / "task_helpers.py").write_text(textwrap.dedent(HELPER))
    (root / "my_task.py").write_text(textwrap.dedent(TASK))
    return root


def test_a_task_file_imports_the_helpers_beside_it(task_dir: Path) -> None:
    fn = load_task(f"{task_dir / 'my_task.py'}:task")
    assert fn(kind="tuple").embedding.__class__.__name__ == "Scaled"


def test_task_files_of_the_same_name_in_two_folders_are_two_modules(tmp_path: Path) -> None:
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same_name.py").write_text(f"def make():\n    return {value}\n")
    assert [load_task(f"{tmp_path / f / 'same_name.py'}:make")() for f in ("a", "b", "a")] == [1, 2, 1]


def test_tuple_and_dict_batches_are_sliced_and_counted_by_their_first_dimension() -> None:
    x, scale = torch.arange(8.0).view(4, 2), torch.arange(4.0).view(4, 1)
    assert batch_rows((x, scale)) == 4 and batch_rows({"x": x, "scale": scale}) == 4 and batch_rows(x) == 4
    part = local_slice({"x": x, "scale": scale}, 1, 2)
    assert torch.equal(part["x"], x[2:]) and torch.equal(part["scale"], scale[2:])
    first, second = rows_of((x, scale), 0, 1)
    assert torch.equal(first, x[:1]) and torch.equal(second, scale[:1])
    with pytest.raises(ValueError, match="must hold tensors with a batch dimension"):
        batch_rows(("no", "tensors"))


def _train(task_dir: Path, kind: str) -> str:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--task", f"{task_dir / 'my_task.py'}:task", "--task-option", f"kind={kind}",
                              "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "8",
                              "--steps", "2", "--log-every", "0"])
    out = io.StringIO()
    assert train_main(args, out) == 0
    return out.getvalue()


@pytest.mark.timeout(120)
def test_train_runs_a_task_file_that_imports_its_helpers(task_dir: Path) -> None:
    assert "1f1b on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps" in _train(task_dir, "tensor")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_train_runs_a_task_whose_batch_is_a_tuple_or_dict(task_dir: Path, kind: str) -> None:
    assert "1f1b on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps" in _train(task_dir, kind)


@pytest.mark.timeout(120)
def test_progress_to_a_pipe_prints_plain_lines(task_dir: Path) -> None:
    """--progress wrote one carriage-return line for the whole run into a file or pipe."""
    cmd = [sys.executable, "-m", "duplexpipe.cli", "train", "--task", f"{task_dir / 'my_task.py'}:task",
           "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "8", "--steps", "3",
           "--log-every", "0", "--progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, check=True).stdout
    assert "\r" not in out
    assert [line.split("  ")[0] for line in out.splitlines() if line.startswith("step ")] == \
        ["step 1/3", "step 2/3", "step 3/3"], out
