"""Compressed data parallelism: each bucket is averaged by a duplexpipe.comm reducer (bf16, int8, PowerSGD,
top-k, DGC, ...) on a data-parallel group of its own, with error feedback committed only on applied steps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.comm import Bucket, Reduction, Waitable, build_reducer, check_optimizer
from duplexpipe.comm.adaptive_reducer import AdaptiveReducer
from duplexpipe.comm.dgc import local_clip_threshold
from duplexpipe.comm.link import EmulatedLink
from duplexpipe.dp_options.compression import AdaptiveOptions, DGCOptions
from duplexpipe.parallel import grads
from duplexpipe.parallel.buckets import BucketSpec
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.parallel.strategy import DPStrategy, StrategyContext, WaitFn


def own_group(mine: Any, device: torch.device, wait: WaitFn) -> Any:
    """A new process group over the ranks of `mine` (a group; None: the world), made collectively over the
    whole job: every rank learns every rank's group (all the same size) and creates each, in the same order."""
    ranks = torch.tensor(dist.get_process_group_ranks(mine) if mine is not None else range(dist.get_world_size()),
                         dtype=torch.int64, device=device)
    everyone = ranks.new_empty(dist.get_world_size() * ranks.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    wait(gather(everyone, ranks, async_op=True), "the process group exchange")
    found = None
    for row in sorted({tuple(row) for row in everyone.view(-1, ranks.numel()).tolist()}):
        group = dist.new_group(list(row))
        if dist.get_rank() in row:
            found = group
    return found


def own_dp_group(groups: ParallelGroups, device: torch.device, wait: WaitFn) -> Any:
    """A new process group over this rank's data-parallel replicas (collective over the whole job)."""
    return own_group(groups.dp_group, device, wait)


def local_clip_norm(options: Any) -> float | None:
    """DGC's local clipping threshold (clip_norm), applied by the strategy over the replica's whole model."""
    return options.clip_norm if isinstance(options, DGCOptions) else None


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

    DGC with clip_norm (local gradient clipping, Lin et al. 2018, Sec. 3.2): the paper clips each worker's
    whole gradient before the momentum (to clip_norm * sqrt(N) in mean-gradient units, see
    comm.dgc.local_clip_threshold). Here a worker is a replica spread over the pipeline ranks, so the buckets
    wait until finish(): the squared norm of this rank's gradients (each weight group counted once) is
    summed over the replica's pipeline ranks, every bucket is scaled by min(1, threshold / norm), and only
    then do the reductions start (they no longer overlap the backward). The reducer itself is built without
    clip_norm (it would clip each bucket by its own norm).
    """

    name = "compressed"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        rungs = ctx.compression.gradient_rungs() if isinstance(ctx.compression, AdaptiveOptions) else ()
        for options in (ctx.compression, *rungs):  # adaptive: every rung of its ladder may run
            check_optimizer(options, self.optimizer)
        check_dgc_momentum(ctx.compression, self.optimizer)
        self.group = own_dp_group(ctx.groups, ctx.device, ctx.wait)
        """This strategy's own data-parallel group (PowerSGD's chained all-reduces need one to themselves)."""
        self.clip_norm = local_clip_norm(ctx.compression) if self.buckets else None
        """DGC's local clipping threshold over the replica's whole gradient (None: no local clipping)."""
        self.replica_group = (own_group(ctx.groups.pp_group, ctx.device, ctx.wait)
                              if self.clip_norm is not None and ctx.groups.pp_size > 1 else None)
        """A group of this replica's pipeline ranks for the local norm (None: no clipping or one rank)."""
        options = ctx.compression
        if isinstance(options, DGCOptions) and options.clip_norm is not None:
            options = replace(options, clip_norm=None)  # clipped here, over the whole replica
        self.reducer = build_reducer(options, self.group, self.meter, [spec.index for spec in self.buckets])
        self.comm_buckets = {spec.index: Bucket(spec.index, spec.shapes,
                                                dtype=spec.dtype, device=ctx.device) for spec in self.buckets}
        self._inflight: list[tuple[BucketSpec, Reduction]] = []
        self._held: list[BucketSpec] = []
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
        """Load the unscaled gradients into the bucket, note inf/NaN, start the reducer (DGC with local
        clipping: hold the bucket until finish_buckets() knows the replica's norm; None is returned)."""
        bucket = self.comm_buckets[spec.index]
        bucket.load(grads.ensure_grads(spec.params))
        buf = bucket.buffer()
        if self.divisor != 1.0:
            buf.div_(self.divisor)
        self._bad |= ~torch.isfinite(buf).all()
        if self.clip_norm is not None:  # reduced in finish_buckets(), once the replica's norm is known
            self._held.append(spec)
            return None
        reduction = self.reducer.start(bucket)
        self._inflight.append((spec, reduction))
        return reduction.pending

    def _clip_and_start_held(self) -> None:
        """DGC's local clipping over the replica's whole gradient, then start the held buckets."""
        held, self._held = self._held, []
        if not held or self.clip_norm is None:
            return
        counted = {id(p) for p in self.counted}
        squares = [view.double().square().sum() for spec in held
                   for p, view in zip(spec.params, self.comm_buckets[spec.index].gradients(), strict=True)
                   if id(p) in counted]
        sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self.replica_group is not None:
            self.wait(dist.all_reduce(sq, group=self.replica_group, async_op=True),
                      "the local gradient-norm all-reduce of DGC's clipping")
        threshold = local_clip_threshold(self.clip_norm, self.dp_size)
        coef = torch.clamp(threshold / (sq.sqrt() + 1e-12), max=1.0)
        for spec in held:
            buf = self.comm_buckets[spec.index].buffer()
            buf.mul_(coef.to(buf.dtype))
            self._inflight.append((spec, self.reducer.start(self.comm_buckets[spec.index])))

    def finish_buckets(self) -> None:
        """Finish each reduction in start order; store the averaged gradients into .grad."""
        self._clip_and_start_held()
        inflight, self._inflight = self._inflight, []
        for spec, reduction in inflight:
            with self.exposed(spec.index):
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
        """Commit (applied) or roll back the reducer's residuals and compressor state; adaptive compression then
        settles the previous window's agreement (complete by now: this window's reductions came after it on the same
        group) and posts this window's."""
        self.reducer.end_step(applied)
        if isinstance(self.reducer, AdaptiveReducer) and self.buckets:
            self.report = self.reducer.finish_step(self.exposed_s, self.window_s, self._loss, self.ctx.device,
                                                   self.wait)

    def emulate_link(self, link: EmulatedLink | None) -> None:
        """Hold the reducer's collectives for `link`."""
        self.reducer.set_link(link)

    def state_dict(self) -> dict[str, Any]:
        """The reducer's residuals and state (this data-parallel rank's own)."""
        return {"method": self.method, "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s reducer state."""
        if state.get("method") != self.method:
            raise ValueError(f"checkpoint holds data-parallel state of method {state.get('method')!r}, "
                             f"this pipeline compresses with {self.method!r}")
        self.reducer.load_state_dict(state["reducer"])
