"""Non-finite gradients in a Pipeline step: the policies, and the error every rank raises naming the step and the
first stage and parameter that held NaN or inf (found after the shared verdict, so it costs nothing on clean steps)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.config.sections import NONFINITE_GRADS as NONFINITE_GRADS
from duplexpipe.config.sections import check_nonfinite_policy as check_nonfinite_policy
from duplexpipe.errors import NonFiniteGradientError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor (ZeRO-2, tensor parallelism): this rank's shard
    return to_local() if callable(to_local) else tensor


def first_nonfinite(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[str, str] | None:
    """(name, "nan" | "inf") of the first parameter whose gradient holds NaN or inf; None when all are finite."""
    for name, param in named:
        if param.grad is None:
            continue
        grad = _local(param.grad.detach())
        if grad.numel() and not bool(torch.isfinite(grad).all()):
            return name, "nan" if bool(torch.isnan(grad).any()) else "inf"
    return None


def located(modules: dict[int, nn.Module], names: dict[str, str]) -> tuple[int, str, str] | None:
    """(stage, parameter name, kind) of this rank's first non-finite gradient in stage order; `names` maps
    `stage<s>.<local name>` to the model's own names where known."""
    for stage in sorted(modules):
        found = first_nonfinite(modules[stage].named_parameters())
        if found is not None:
            local, kind = found
            return stage, names.get(f"stage{stage}.{local}", local), kind
    return None


def nonfinite_error(step: int, norm: float | None, mine: tuple[int, str, str] | None) -> NonFiniteGradientError:
    """The error every rank raises (collective: every rank calls, with its own `located` finding)."""
    everyone: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    found = sorted((f[0], rank, f[1], f[2]) for rank, f in enumerate(everyone) if f is not None)
    shown = "nan" if norm is None or math.isnan(norm) else f"{norm}"
    if found:
        stage, rank, name, kind = found[0]
        where = f"stage {stage}, parameter {name!r} (rank {rank}) holds {kind}"
    else:
        where = "a reduced gradient shard holds NaN or inf"
    return NonFiniteGradientError(
        f"step {step}: non-finite gradients, the first in {where}; gradient norm {shown}. The optimizer did not "
        "step (the weights are those before this step); lower the learning rate, check the data, or set "
        "PipelineConfig(nonfinite_grads='skip') to skip such steps")
