"""Tests for duplexpipe.launch.batch_streams: a TrainTask fed by a DataLoader walks its epochs by step whatever the
loader's batch size, a resumed run sees the same batches, held-out batches wrap around; the training guide's
loader task trains from the command line with its evaluation."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from duplexpipe.launch.batch_streams import HeldOutBatches, StreamedBatches

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = torch.arange(20.0).unsqueeze(1)


def _epoch(n: int) -> DataLoader:
    return DataLoader(TensorDataset(SAMPLES, -SAMPLES), batch_size=3, shuffle=True,
                      generator=torch.Generator().manual_seed(n))


def test_steps_walk_the_loaders_epochs_whatever_their_batch_size() -> None:
    batches = StreamedBatches(_epoch)
    walk = torch.cat([x for x, _ in _epoch(0)] + [x for x, _ in _epoch(1)])
    steps = [batches(step, 4) for step in range(10)]  # two epochs of 20 samples in batches of 4 from batches of 3
    assert torch.equal(torch.cat([x for x, _ in steps]), walk) and all(torch.equal(y, -x) for x, y in steps)
    assert batches.epoch == 1 and sorted(walk[:20, 0].tolist()) == sorted(walk[20:, 0].tolist()) == list(range(20))
    assert torch.equal(StreamedBatches(_epoch)(7, 4)[0], steps[7][0])  # a resumed run: the same batch
    assert torch.equal(batches(2, 4)[0], steps[2][0])  # an earlier step: read again from the start
    with pytest.raises(ValueError, match="the batches of epoch 0 hold no sample"):
        StreamedBatches(lambda n: [])(0, 4)


def test_held_out_batches_are_read_once_in_order_and_wrap_around() -> None:
    made = []

    def loader() -> DataLoader:
        made.append(1)
        return DataLoader(TensorDataset(SAMPLES[:5]), batch_size=2)

    held = HeldOutBatches(loader)
    assert held.has_samples() and held(0, 3)[0][:, 0].tolist() == [0, 1, 2]
    assert held(1, 3)[0][:, 0].tolist() == [3, 4, 0] and held(0, 3)[0][:, 0].tolist() == [0, 1, 2]
    assert made == [1]
    empty = HeldOutBatches(lambda: [])
    assert not empty.has_samples()
    with pytest.raises(ValueError, match="the held-out batches hold no sample"):
        empty(0, 2)


@pytest.mark.timeout(300)
def test_the_guides_loader_task_trains_with_its_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    from duplexpipe.cli.train_cmd import add_train_arguments, train_main

    guide = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(# loader_task\.py: (duplexpipe train .*?)\n.*?)```", guide, re.S)
    assert code is not None, "the guide's loader task"
    (tmp_path / "loader_task.py").write_text(code.group(1), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    words = code.group(2).split()[2:] + ["--steps", "12", "--eval-every", "6", "--log-every", "6", "--lr", "1e-2",
                                        "--no-tensorboard", "--out-dir", "out"]
    out = io.StringIO()
    assert train_main(parser.parse_args(words), out) == 0
    text = out.getvalue() + capfd.readouterr().out
    # the ranks' own lines go to the stdout of the process that serves them (a forkserver an earlier test may have
    # started): the evaluations are read from the metrics file
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval_loss"] for row in rows if row.get("eval_loss") is not None]
    summary = "on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 12 steps"
    assert summary in text and len(evals) == 2 and evals[1] < evals[0], text
