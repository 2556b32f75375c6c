"""Gradients across ranks: the global norm with a shared overflow flag, clipping and scaling."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.comm.local_tensors import local_of
from duplexpipe.runtime.backward.compat import foreach_mul_, foreach_norm

Waiter = Callable[[Any, str], None]
"""wait(work, what): waits for a collective posted with async_op=True (bounded and failure-aware,
e.g. PipelineRuntime.bounded); `what` names it in errors."""


def _wait_unbounded(work: Any, what: str) -> None:
    work.wait()


def ensure_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Every trainable parameter's grad, zero-filled where a parameter received none (of a DTensor parameter, the
    local tensor of its grad: tensor parallelism reduces and steps local shards)."""
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local_of(p.grad))
    return grads


def _norms(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each gradient's L2 norm in float64, on `device` (one fused pass over all of them; of a DTensor gradient, its
    local shard's). float64 keeps the norm of a sharded gradient (ZeRO) bit-equal to the whole one's."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    found = foreach_norm([local_of(g).detach() for g in grads], torch.float64)
    first = found[0].device
    if all(n.device == first for n in found):
        return torch.stack(found).to(device)
    return torch.stack([n.to(device) for n in found])


def global_norm_and_overflow(
    counted: Sequence[torch.Tensor],
    checked: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
    count_here: bool = True,
    wait: Waiter = _wait_unbounded,
    flagged: bool | torch.Tensor = False,
) -> tuple[float, bool]:
    """(L2 norm of the `counted` grads over all ranks of `group`, any non-finite grad anywhere).

    `counted` holds each weight group's gradient once over the whole group (a rank passes
    only the copies it owns); `checked` holds every local grad, scanned for inf/NaN. A rank with
    `count_here=False` (e.g. a data-parallel replica other than the first) adds no norm but still
    reports overflow. `flagged` adds an overflow this rank found earlier (e.g. in its gradients before
    they were compressed). One all-reduce carries both, so every rank gets the same verdict. The norm is never
    masked: NaN or inf in a counted gradient makes it NaN or inf. Each distinct gradient is read once (one fused
    norm per tensor, float64), whether it is counted, checked or both.
    """
    counted = counted if count_here else []
    index = {id(g): i for i, g in enumerate(checked)}
    plain = len(index) == len(checked) and all(id(g) in index for g in counted)  # the usual case
    distinct = checked if plain else list({id(g): g for g in (*counted, *checked)}.values())
    if not plain:
        index = {id(g): i for i, g in enumerate(distinct)}
    norms = _norms(distinct, device)
    every = len(counted) == len(distinct) == len({id(g) for g in counted})  # each distinct grad counted once
    counted_sq = (norms if every else norms[[index[id(g)] for g in counted]]).square().sum()
    checked_sum = norms.sum() if plain else norms[[index[id(g)] for g in checked]].sum()
    stats = torch.stack([counted_sq, (~torch.isfinite(checked_sum) | flagged).to(torch.float64)])
    if dist.is_available() and dist.is_initialized():
        work = dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group, async_op=True)
        wait(work, "the gradient-norm and overflow all-reduce")
    norm_sq, overflow = stats.tolist()
    return float(norm_sq) ** 0.5, overflow > 0


def scale_grads(params: Iterable[nn.Parameter], factor: float) -> None:
    """Multiply every existing grad by `factor` (skipped when factor == 1)."""
    if factor == 1.0:
        return
    found = [local_of(p.grad) for p in params if p.grad is not None]  # a DTensor's shard scales alike
    if found:
        foreach_mul_(found, factor)


def clip_factor(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
