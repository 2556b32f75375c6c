"""Gradients across ranks: data-parallel all-reduce, global norm with a shared overflow flag, scaling."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 32 * 2**20
Waiter = Callable[[Any, str], None]
"""wait(work, what): waits for a collective posted with async_op=True (bounded and failure-aware,
e.g. PipelineRuntime.bounded); `what` names it in errors."""


def _wait_unbounded(work: Any, what: str) -> None:
    work.wait()


def ensure_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Every trainable parameter's grad, zero-filled where a parameter received none."""
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most `limit` bytes (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is None or last[0].dtype != t.dtype or last[0].device != t.device or size + nbytes > limit:
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out


def all_reduce_mean(
    params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, group_size: int,
    bucket_bytes: int = BUCKET_BYTES, wait: Waiter = _wait_unbounded,
) -> None:
    """Average the grads of `params` over `group` (data-parallel replicas), in flat buckets.

    Every member must pass the same parameters in the same order (a missing grad counts as 0).
    Each bucket's all-reduce is waited for with `wait` (pass a bounded one, e.g. PipelineRuntime.bounded).
    """
    if group_size <= 1:
        return
    grads = ensure_grads(params)
    buckets = _buckets(grads, bucket_bytes)
    for index, bucket in enumerate(buckets):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        wait(work, f"the data-parallel gradient all-reduce (bucket {index + 1} of {len(buckets)})")
        flat.div_(group_size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _sum_squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float64).square()
    return total


def global_norm_and_overflow(
    counted: Sequence[torch.Tensor],
    checked: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
    count_here: bool = True,
    wait: Waiter = _wait_unbounded,
) -> tuple[float, bool]:
    """(L2 norm of the `counted` grads over all ranks of `group`, any non-finite grad anywhere).

    `counted` holds each weight group's gradient once over the whole group (a rank passes
    only the copies it owns); `checked` holds every local grad, scanned for inf/NaN. A rank with
    `count_here=False` (e.g. a data-parallel replica other than the first) adds no norm but still
    reports overflow. One all-reduce carries both, so every rank gets the same verdict.
    """
    counted_sq = _sum_squares(counted, device) if count_here else torch.zeros((), dtype=torch.float64,
                                                                                device=device)
    all_sq = _sum_squares(checked, device)
    bad = (~torch.isfinite(all_sq)).to(torch.float64)
    stats = torch.stack([counted_sq.nan_to_num(0.0, 0.0, 0.0), bad])
    if dist.is_available() and dist.is_initialized():
        work = dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group, async_op=True)
        wait(work, "the gradient-norm and overflow all-reduce")
    norm_sq, overflow = stats.tolist()
    return float(norm_sq) ** 0.5, overflow > 0


def scale_grads(params: Iterable[nn.Parameter], factor: float) -> None:
    """Multiply every existing grad by `factor` (skipped when factor == 1)."""
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def clip_factor(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
