"""Tests for duplexpipe.launch.tasks.gpt (the default training task) and examples/gpt.py, its thin user."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from duplexpipe.launch.tasks import gpt
from duplexpipe.launch.train_task import TrainTask

ROOT = Path(__file__).resolve().parents[3]


def test_model_shapes_and_causality() -> None:
    cfg = gpt.GPTConfig(vocab_size=11, block_size=8, d_model=16, n_head=2, n_layer=2)
    embedding, blocks, head = gpt.build_gpt(cfg, seed=0)
    idx = torch.randint(0, 11, (3, 8))
    x = embedding(idx)
    for block in blocks:
        x = block(x)
    logits = head(x)
    assert logits.shape == (3, 8, 11)
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11  # the future must not change earlier positions
    y = embedding(changed)
    for block in blocks:
        y = block(y)
    torch.testing.assert_close(head(y)[:, :5], logits[:, :5])
    assert not torch.allclose(head(y)[:, 5:], logits[:, 5:])
    loss = gpt.lm_loss(logits, idx)
    assert loss.dim() == 0 and abs(loss.item() - torch.log(torch.tensor(11.0)).item()) < 0.5


def test_same_seed_same_weights() -> None:
    cfg = gpt.GPTConfig(vocab_size=11, block_size=8, d_model=16, n_head=2, n_layer=2)
    a, b = gpt.build_gpt(cfg, seed=3), gpt.build_gpt(cfg, seed=3)
    c = gpt.build_gpt(cfg, seed=4)
    assert torch.equal(a[1][1].mlp[0].weight, b[1][1].mlp[0].weight)
    assert not torch.equal(a[1][1].mlp[0].weight, c[1][1].mlp[0].weight)
    with pytest.raises(ValueError, match="d_model 10 is not a multiple of n_head 4"):
        gpt.GPTConfig(d_model=10, n_head=4)


def test_corpus_is_package_data_with_deterministic_batches() -> None:
    corpus = gpt.CharCorpus()
    assert corpus.vocab_size == 73 and 300_000 < len(corpus.text) < 500_000
    assert corpus.text.startswith("GENESIS\n\nChapter 1\n\n1:1 In the beginning God created")
    assert gpt.corpus_text() == (ROOT / "duplexpipe" / "launch" / "tasks" / "data" / gpt.CORPUS_NAME).read_text()
    x, y = corpus.batch(5, 4, 16)
    x2, y2 = corpus.batch(5, 4, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, corpus.batch(6, 4, 16)[0])
    assert corpus.decode(x[0]) in corpus.text


def test_gpt_task_batches_take_the_step_and_the_batch_size() -> None:
    task = gpt.gpt_task(n_layer=2, d_model=16, n_head=2, block_size=8)
    assert isinstance(task, TrainTask)
    assert len(task.layers) == 2 and task.items_per_sample == 8 and task.item_name == "tokens"
    x, y = task.batch(0, 4)
    assert x.shape == y.shape == (4, 8)
    assert task.batch(0, 6)[0].shape == (6, 8)
    assert task.eval_batch is not None
    held, targets = task.eval_batch(1, 4)
    assert held.shape == (4, 8) and torch.equal(held, task.eval_batch(1, 4)[0])
    assert torch.equal(held[:, 1:], targets[:, :-1])
    val = gpt.CharCorpus().val  # every held-out window is a window of the validation split
    assert all(any(torch.equal(w, val[s:s + 8]) for s in range(len(val) - 8)) for w in held)


def test_example_script_is_a_thin_user_of_the_task() -> None:
    spec = importlib.util.spec_from_file_location("example_gpt", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["example_gpt"] = module
    spec.loader.exec_module(module)
    assert module.gpt_task is gpt.gpt_task and module.build_gpt is gpt.build_gpt
    assert callable(module.run_demo)
