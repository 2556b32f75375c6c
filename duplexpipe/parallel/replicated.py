"""Replicated data parallelism: every replica holds all weights; buckets are summed by an fp32 all-reduce."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm import Waitable
from duplexpipe.parallel import grads
from duplexpipe.parallel.buckets import BucketSpec
from duplexpipe.parallel.strategy import DPStrategy


def post_all_reduce(flat: Tensor, group: Any) -> Any:
    """Post the asynchronous sum of `flat` over `group` (the replicated strategy's one collective)."""
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


class ReplicatedStrategy(DPStrategy):
    """Plain data parallelism, numerically what duplexpipe always did: each bucket's gradients (still
    multiplied by the loss scale and window weight) are summed over the data-parallel group with one
    all-reduce started as soon as they are final, divided by the group size, and written back; the norm,
    overflow check, clipping and unscaling follow on the reduced gradients."""

    name = "replicated"

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._inflight: list[tuple[BucketSpec, Tensor, Any]] = []

    def start_bucket(self, spec: BucketSpec) -> Waitable | None:
        """Copy the bucket's gradients into one flat buffer and post its all-reduce."""
        flat = torch.cat([g.reshape(-1) for g in grads.ensure_grads(spec.params)])
        self.meter.record("all_reduce", flat.numel() * flat.element_size(), self.dp_size)
        work = post_all_reduce(flat, self.ctx.groups.dp_group)
        self._inflight.append((spec, flat, work))
        return work  # type: ignore[no-any-return]

    def finish_buckets(self) -> None:
        """Wait for each all-reduce in start order, average, and copy back into .grad."""
        inflight, self._inflight = self._inflight, []
        total = len(self.buckets)
        for spec, flat, work in inflight:
            with self.exposed(spec.index):
                self.wait(work, f"the data-parallel gradient all-reduce (bucket {spec.index + 1} of {total})")
            flat.div_(self.dp_size)
            offset = 0
            for grad in grads.ensure_grads(spec.params):  # local shards under tensor parallelism
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
