"""A task's batches in a run: counting their samples, slicing them per data-parallel replica, and the held-out
evaluation (`--eval-every`): the mean loss over the task's first eval batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only

from duplexpipe.train.trainer import Pipeline

EvalBatch = Callable[[int, int], tuple[Any, Any]]
"""eval_batch(index, batch_size) -> (inputs, targets) of a held-out batch (`TrainTask.eval_batch`)."""


def batch_rows(value: Any) -> int:
    """Samples in a batch's inputs or targets: a tensor, or a tuple / list / dict of them (the first
    dimension of the first tensor)."""
    first = next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError(f"a batch must hold tensors with a batch dimension, got {type(value).__name__}")
    return int(first.shape[0])


def rows_of(value: Any, lo: int, hi: int) -> Any:
    """Samples lo..hi-1 of every tensor in `value` (a tensor, or a tuple / list / dict of them)."""
    return tree_map_only(torch.Tensor, lambda t: t[lo:hi], value)


def local_slice(value: Any, index: int, parts: int) -> Any:
    """Replica `index`'s share of a global batch split into `parts` equal shares (the batch itself for one)."""
    if parts == 1 or value is None:
        return value
    size, left = divmod(batch_rows(value), parts)
    if left:
        raise ValueError(f"a batch of {batch_rows(value)} samples does not split into {parts} equal data-parallel "
                         "shares: the task's batch must hold batch_size samples, a multiple of dp")
    return rows_of(value, index * size, (index + 1) * size)


def evaluate_batches(pipe: Pipeline, eval_batch: EvalBatch, batch_size: int, count: int) -> float:
    """The mean loss of held-out batches 0..count-1 (forward only, `Pipeline.evaluate`), each replica evaluating its
    share and the shares averaged over the data-parallel replicas; the same on every rank."""
    groups = pipe.groups
    total = 0.0
    for index in range(count):
        x, y = (local_slice(v, groups.dp_rank, groups.dp_size) for v in eval_batch(index, batch_size))
        loss = pipe.evaluate(x, y).loss
        if loss is None:
            raise ValueError("evaluation gave no loss: the task's eval_batch must give targets")
        total += loss
    mean = torch.tensor([total / count], dtype=torch.float64, device=pipe.device)
    if groups.dp_size > 1:
        pipe.bounded(dist.all_reduce(mean, group=groups.dp_group, async_op=True), "the eval loss all-reduce")
        mean /= groups.dp_size
    return float(mean.item())
