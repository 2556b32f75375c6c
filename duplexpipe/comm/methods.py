"""Gradient compression options (their one table is `duplexpipe.dp_options.compression`, torch-free, re-exported
here) and the optimizer check for sparsifiers, which needs torch."""

from __future__ import annotations

from typing import Any

import torch

from duplexpipe.dp_options.compression import (
    METHOD_NAMES,
    Bf16Options,
    DGCOptions,
    Fp16Options,
    Int8Options,
    NoCompression,
    Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
    compression_options,
)

__all__ = ["ADAPTIVE_OPTIMIZERS", "METHOD_NAMES", "Bf16Options", "DGCOptions", "Fp16Options", "Int8Options",
           "NoCompression", "Options", "PowerSGDOptions", "RandomKOptions", "ThresholdOptions", "TopKOptions",
           "check_optimizer", "compression_options"]


ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                       torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
                       torch.optim.SparseAdam)
"""Optimizers with per-coordinate adaptive step sizes (error feedback of a sparsifier misbehaves under them)."""


def check_optimizer(options: Options, optimizer: Any) -> None:
    """Raise ValueError if a sparsifying method (top-k, random-k, threshold, DGC) is used with an
    Adam-family optimizer without `allow_adaptive_optimizer=True`. A wrapper exposing `.optim` (torch's
    ZeroRedundancyOptimizer) is checked through."""
    if not isinstance(options, (TopKOptions, DGCOptions)) or options.allow_adaptive_optimizer:
        return
    inner = getattr(optimizer, "optim", optimizer)
    if isinstance(inner, ADAPTIVE_OPTIMIZERS):
        raise ValueError(
            f"gradient compression {options.method!r} assumes SGD (with momentum), got {type(inner).__name__}: "
            "top-k with error feedback under AdamW lost 8.7% on the GPT example; pass "
            "allow_adaptive_optimizer=True to use it anyway")
