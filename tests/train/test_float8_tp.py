"""Tests for duplexpipe.train.float8_tp: which plain TP styles become torchao's float8 ones (converted linears without
a bias, tensorwise casts; over gloo only where no float8 crosses a collective), with the same layouts."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from duplexpipe.train.float8 import Float8Options, convert_stages

pytest.importorskip("torchao")
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel  # noqa: E402

from duplexpipe.train.float8_tp import BIAS, GLOO, SCALING, Float8Styles, log_styles  # noqa: E402


def _linear(recipe: str = "tensorwise", bias: bool = False) -> nn.Module:
    holder = nn.Sequential(nn.Linear(32, 32, bias=bias))
    convert_stages({0: holder}, Float8Options(recipe, emulate=True), torch.device("cpu"))
    return holder[0]


def test_plain_styles_become_torchaos_with_the_same_layouts() -> None:
    styles = Float8Styles(float8_collectives=True)
    col = styles("q", _linear(), ColwiseParallel(input_layouts=Shard(1), use_local_output=False))
    row = styles("proj", _linear(), RowwiseParallel(output_layouts=Shard(1)))
    assert type(col) is Float8ColwiseParallel and type(row) is Float8RowwiseParallel
    assert col.input_layouts == (Shard(1),) and not col.use_local_output  # type: ignore[attr-defined]
    assert row.output_layouts == (Shard(1),) and row.use_local_output  # type: ignore[attr-defined]
    assert styles.float8 == ["q", "proj"] and styles.plain == {}
    assert "2 linears under torchao's Float8ColwiseParallel" in styles.summary()


def test_the_plain_styles_stay_where_torchaos_would_differ() -> None:
    styles = Float8Styles(float8_collectives=False)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    kept = [(_linear(bias=True), ColwiseParallel()), (_linear("rowwise"), ColwiseParallel()),
            (_linear(), ColwiseParallel(input_layouts=Shard(1))), (_linear(), RowwiseParallel(output_layouts=Shard(1))),
            (nn.Linear(32, 32, bias=False), ColwiseParallel()), (_linear(), gather)]
    for k, (module, style) in enumerate(kept):
        assert styles(str(k), module, style) is style
    assert styles.plain == {BIAS: ["0"], SCALING: ["1"], GLOO: ["2", "3"]}  # nn.Linear and PrepareModuleInput: as is
    assert type(styles("4", _linear(), RowwiseParallel())) is Float8RowwiseParallel  # gloo: no float8 collective
    assert "3 under the plain styles" not in styles.summary() and "2 under the plain styles" in styles.summary()


def test_one_log_line_says_which_styles_and_why(caplog: pytest.LogCaptureFixture) -> None:
    styles = Float8Styles(float8_collectives=False)
    styles("a", _linear(), ColwiseParallel())
    styles("b", _linear(bias=True), RowwiseParallel())
    with caplog.at_level(logging.INFO, logger="duplexpipe.float8"):
        log_styles(styles, callable_plan=False)
        log_styles(None, callable_plan=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"float8 tensor parallelism: {styles.summary()}"
    assert "1 linears under torchao's" in lines[0] and f"1 under the plain styles ({BIAS})" in lines[0]
    assert "the tp_plan is a callable and applies its own styles" in lines[1]
