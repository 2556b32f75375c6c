"""Tests for duplexpipe.comm.methods and build: names, validation errors naming the value, optimizer check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from duplexpipe.comm.methods import check_optimizer
from duplexpipe.dp_options.compression import (
    METHOD_NAMES,
    DGCOptions,
    Int8Options,
    NoCompression,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
    compression_options,
)


def test_names_give_default_options() -> None:
    assert METHOD_NAMES == ("none", "bf16", "fp16", "powersgd", "int8", "topk", "randomk", "threshold", "dgc",
                            "adaptive")
    for name in METHOD_NAMES:
        assert compression_options(name).method == name
    assert compression_options("TopK") == TopKOptions()
    assert compression_options(None) == NoCompression()
    opts = DGCOptions(ratio=0.001, warmup_steps=10)
    assert compression_options(opts) is opts
    assert Int8Options().block == 256 and PowerSGDOptions().rank == 4


@pytest.mark.parametrize("spec", ["int4", "", 3])
def test_unknown_method_names_the_value(spec: object) -> None:
    with pytest.raises(ValueError, match=f"unknown gradient compression {spec!r}"):
        compression_options(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("make,message", [
    (lambda: TopKOptions(ratio=0.0), "ratio must be in \\(0, 1\\], got 0.0"),
    (lambda: TopKOptions(ratio=1.01), "ratio must be in \\(0, 1\\], got 1.01"),
    (lambda: RandomKOptions(ratio=-1), "ratio must be in \\(0, 1\\], got -1"),
    (lambda: ThresholdOptions(ratio=2.0), "ratio must be in \\(0, 1\\], got 2.0"),
    (lambda: ThresholdOptions(theta=1.5), "theta must be in \\[0, 1\\], got 1.5"),
    (lambda: DGCOptions(ratio=0), "ratio must be in \\(0, 1\\], got 0"),
    (lambda: DGCOptions(momentum=1.0), "dgc momentum must be in \\[0, 1\\), got 1.0"),
    (lambda: DGCOptions(clip_norm=0.0), "dgc clip_norm must be > 0 or None, got 0.0"),
    (lambda: DGCOptions(warmup_steps=-2), "warmup_steps must be an int >= 0, got -2"),
    (lambda: DGCOptions(selection="layer"), "dgc selection must be 'bucket' or 'tensor', got 'layer'"),
    (lambda: PowerSGDOptions(rank=0), "powersgd rank must be an int >= 1, got 0"),
    (lambda: PowerSGDOptions(start_step=1), "start_step must be an int >= 2 .*, got 1"),
    (lambda: Int8Options(block=0), "int8 block must be an int >= 1, got 0"),
    (lambda: RandomKOptions(seed=-3), "seed must be an int >= 0, got -3"),
])
def test_bad_options_name_the_value(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_sparsifiers_refuse_adaptive_optimizers_unless_allowed() -> None:
    params = list(nn.Linear(2, 2).parameters())
    adamw, sgd = torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for opts in (TopKOptions(), RandomKOptions(), ThresholdOptions(), DGCOptions()):
        with pytest.raises(ValueError, match=f"'{opts.method}' assumes SGD .*got AdamW.*allow_adaptive_optimizer"):
            check_optimizer(opts, adamw)
        check_optimizer(opts, sgd)
    check_optimizer(TopKOptions(allow_adaptive_optimizer=True), adamw)
    check_optimizer(DGCOptions(allow_adaptive_optimizer=True), torch.optim.Adam(params))
    for opts in (NoCompression(), Int8Options(), PowerSGDOptions()):
        check_optimizer(opts, adamw)  # dense methods work with any optimizer

    class Wrapper:  # like ZeroRedundancyOptimizer: the real optimizer in .optim
        optim = torch.optim.RMSprop(params)

    with pytest.raises(ValueError, match="got RMSprop"):
        check_optimizer(TopKOptions(), Wrapper())
