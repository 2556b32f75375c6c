"""Compressed data parallelism: each bucket is averaged by a duplexpipe.comm reducer (bf16, int8, PowerSGD,
top-k, DGC, ...) on a data-parallel group of its own, with error feedback committed only on applied steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.comm import Bucket, DGCOptions, Reduction, Waitable, build_reducer, check_optimizer
from duplexpipe.pipeline import grads
from duplexpipe.pipeline.dp.base import DPStrategy, StrategyContext, WaitFn
from duplexpipe.pipeline.dp.buckets import BucketSpec
from duplexpipe.pipeline.mesh import ParallelGroups


def own_dp_group(groups: ParallelGroups, device: torch.device, wait: WaitFn) -> Any:
    """A new process group over this rank's data-parallel replicas (collective over the whole job: every
    rank learns every data-parallel group and creates each, in the same order)."""
    mine = torch.tensor(dist.get_process_group_ranks(groups.dp_group), dtype=torch.int64, device=device)
    everyone = mine.new_empty(dist.get_world_size() * mine.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    wait(gather(everyone, mine, async_op=True), "the data-parallel group exchange")
    found = None
    for ranks in sorted({tuple(row) for row in everyone.view(-1, mine.numel()).tolist()}):
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            found = group
    return found


def check_dgc_momentum(options: Any, optimizer: torch.optim.Optimizer) -> None:
    """DGC applies its momentum itself (momentum correction): the optimizer must not add its own."""
    if not isinstance(options, DGCOptions):
        return
    momenta = sorted({float(g.get("momentum", 0.0)) for g in optimizer.param_groups})
    if any(m != 0.0 for m in momenta):
        raise ValueError(
            f"gradient compression 'dgc' applies momentum {options.momentum} itself (momentum correction); "
            f"build the optimizer without momentum (e.g. SGD with momentum=0), got momentum {momenta}")


class CompressedStrategy(DPStrategy):
    """Each bucket's gradients, unscaled (divided by the loss scale and window weight, so residuals stay in
    gradient units) and checked for inf/NaN, go through a duplexpipe.comm reducer started as soon as they are
    final; the optimizer waits for all of them. The overflow flag (from the local gradients, before
    compression) and the norm of the reduced gradients are shared in one all-reduce; a skipped step rolls
    the reducer's residuals and state back (end_step(applied=False)).
    """

    name = "compressed"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        check_optimizer(ctx.compression, self.optimizer)
        check_dgc_momentum(ctx.compression, self.optimizer)
        self.group = own_dp_group(ctx.groups, ctx.device, ctx.wait)
        """This strategy's own data-parallel group (PowerSGD's chained all-reduces need one to themselves)."""
        self.reducer = build_reducer(ctx.compression, self.group, self.meter)
        self.comm_buckets = {spec.index: Bucket(spec.index, [tuple(p.shape) for p in spec.params],
                                                dtype=spec.dtype, device=ctx.device) for spec in self.buckets}
        self._inflight: list[tuple[BucketSpec, Reduction]] = []
        self._bad = torch.zeros((), dtype=torch.bool, device=ctx.device)

    @property
    def method(self) -> str:
        """The compression method's name."""
        return self.reducer.method

    def begin_call(self, final: bool, divisor: float) -> None:
        """Also clear the overflow flag at a window's last call."""
        super().begin_call(final, divisor)
        if final:
            self._bad = torch.zeros((), dtype=torch.bool, device=self.ctx.device)

    def start_bucket(self, spec: BucketSpec) -> Waitable | None:
        """Load the unscaled gradients into the bucket, note inf/NaN, start the reducer."""
        bucket = self.comm_buckets[spec.index]
        bucket.load(grads.ensure_grads(spec.params))
        buf = bucket.buffer()
        if self.divisor != 1.0:
            buf.div_(self.divisor)
        self._bad |= ~torch.isfinite(buf).all()
        reduction = self.reducer.start(bucket)
        self._inflight.append((spec, reduction))
        return reduction.pending

    def finish_buckets(self) -> None:
        """Finish each reduction in start order; store the averaged gradients into .grad."""
        inflight, self._inflight = self._inflight, []
        for spec, reduction in inflight:
            reduction.finish(self.wait)
            self.comm_buckets[spec.index].store(grads.ensure_grads(spec.params))

    @property
    def post_divisor(self) -> float:
        """1: the gradients were unscaled before compression."""
        return 1.0

    def local_overflow(self) -> bool | torch.Tensor:
        """Any inf/NaN in this rank's unscaled gradients of the window, before compression."""
        return self._bad

    def checked_grads(self) -> list[torch.Tensor]:
        """None: the overflow check ran on the local gradients, before compression."""
        return []

    def end_step(self, applied: bool) -> None:
        """Commit (applied) or roll back the reducer's residuals and compressor state."""
        self.reducer.end_step(applied)

    def state_dict(self) -> dict[str, Any]:
        """The reducer's residuals and state (this data-parallel rank's own)."""
        return {"method": self.method, "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s reducer state."""
        if state.get("method") != self.method:
            raise ValueError(f"checkpoint holds data-parallel state of method {state.get('method')!r}, "
                             f"this pipeline compresses with {self.method!r}")
        self.reducer.load_state_dict(state["reducer"])
