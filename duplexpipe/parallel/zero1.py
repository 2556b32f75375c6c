"""ZeRO-1: the optimizer state is sharded over the data-parallel group; each bucket (one stage's parameters of
one optimizer param group, in a flat buffer) is reduce-scattered as soon as its gradients are final, the
optimizer steps this rank's shard, and the updated shards are all-gathered into the parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from duplexpipe.comm import Waitable
from duplexpipe.comm.sharded import ShardComm
from duplexpipe.dp_options.compression import Int8Options
from duplexpipe.dp_options.zero import gradient_wire
from duplexpipe.model.stages import inner_module
from duplexpipe.parallel import grads
from duplexpipe.parallel.buckets import BucketSpec, BucketTracker
from duplexpipe.parallel.sharded_optimizer import ShardedOptimizer
from duplexpipe.parallel.strategy import DPStrategy, StrategyContext
from duplexpipe.parallel.zero1_state import (
    dp_global_ranks,
    init_state,
    load_state_dict,
    model_state_dict,
    plain_entries,
    state_dict,
)
from duplexpipe.tp.parallelize import counts_here


def checkpoint_names(ctx: StrategyContext) -> dict[int, tuple[int, str]]:
    """id(parameter) -> (stage, its checkpoint name `stage<s>.<name>`) for this rank's stage modules."""
    return {id(p): (s, f"stage{s}.{name}") for s, m in ctx.modules.items()
            for name, p in inner_module(m).named_parameters()}


def counted_stages(ctx: StrategyContext) -> list[int]:
    """This rank's stages holding the first copy of their weight group (the global norm counts those)."""
    return [s for s in sorted(ctx.modules) if ctx.schedule.copy_of_stage(s) == 0]


def quantized(ctx: StrategyContext) -> bool:
    """Whether gradients or weights go on the wire as int8 (the draw counter, which keys stochastic rounding
    and says whether the weights were ever quantized, is then strategy state)."""
    wires = (gradient_wire(ctx.zero_stage, ctx.zero, ctx.compression), ctx.zero.weight_wire)
    return any(isinstance(w, Int8Options) for w in wires)


class Zero1Strategy(DPStrategy):
    """Optimizer states sharded (Megatron's distributed-optimizer layout); traffic per step: one
    reduce-scatter and one all-gather of the flat buffers, together one all-reduce's worth."""

    name = "zero1"

    def __init__(self, ctx: StrategyContext) -> None:
        self.draws = 0
        """Applied steps: keys the random draws of stochastic int8 rounding (restored with the checkpoint)."""
        super().__init__(ctx)
        self.buckets = [BucketSpec(f.index, tuple(f.params), frozenset({f.stage})) for f in self.sharded.flats]
        self.tracker = BucketTracker(self.buckets)

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer class and param groups, rebuilt over this rank's flat shards."""
        ctx = self.ctx
        comm = (ShardComm(ctx.groups.dp_group, self.meter, gradients=gradient_wire(1, ctx.zero, ctx.compression),
                          weights=ctx.zero.weight_wire) if ctx.groups.dp_size > 1 else None)
        self.sharded = ShardedOptimizer(ctx.optimizer_factory(self.params), checkpoint_names(ctx), comm,
                                        own_master=ctx.zero.weight_wire is not None,
                                        trust_elementwise=ctx.zero.trust_elementwise, whole=ctx.experts)
        return self.sharded.optimizer

    def zero_grad(self) -> None:
        """Drop the parameters' and the shards' gradients."""
        for p in self.params:
            p.grad = None
        self.sharded.zero_grad()

    def start_bucket(self, spec: BucketSpec) -> Waitable | None:
        """Copy the bucket's gradients into its flat buffer and post its reduce-scatter."""
        pending = self.sharded.start(self.sharded.flats[spec.index], draw=self.draws)
        return pending.work if pending is not None else None

    def finish_buckets(self) -> None:
        """Wait for the reduce-scatters: each shard's mean gradient is in place."""
        self.sharded.finish(self.ctx.wait)

    def checked_grads(self) -> list[Tensor]:
        """The reduced gradient shards (an inf/NaN anywhere in a sum lands in its owner's shard), and the
        experts' whole gradients."""
        return self.sharded.shard_grads() + [p.grad for p in self.expert_params if p.grad is not None]

    def norm_and_overflow(self, need: bool) -> tuple[float | None, bool]:
        """Every data-parallel rank counts its own shards of the first copies (each element once)."""
        if not need:
            return None, False
        raw, overflow = grads.global_norm_and_overflow(
            self.sharded.shard_grads(counted_stages(self.ctx), self._counted_over_tp) + self.counted_grads(),
            self.checked_grads(), None,
            self.ctx.device, count_here=True, wait=self.ctx.wait, flagged=self.local_overflow())
        return raw / self.post_divisor, overflow

    def _counted_over_tp(self, p: nn.Parameter) -> bool:
        """Whether this TP rank counts `p`'s shard pieces in the norm (`tensor.counts_here`)."""
        return counts_here(p, self.ctx.groups.tp_rank)

    def step(self, clip_coef: float) -> None:
        """Scale the shards' gradients by clip_coef / post_divisor, step the shards, all-gather them."""
        self.sharded.scale_(clip_coef / self.post_divisor)
        grads.scale_grads(self.expert_params, clip_coef / self.post_divisor)
        self.sharded.step(self.ctx.wait, draw=self.draws)
        self.draws += 1
        self.end_step(applied=True)

    def checkpoint_dicts(self, modules: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's state dict and the optimizer state per parameter, each rank holding its pieces."""
        if self.expert_params:
            raise ValueError("checkpoints of ZeRO-1 with MoE experts are not supported yet: save with "
                             "zero_stage=0 (ZeRO-1 keeps the experts whole), or 2 or 3 with ep below dp (the experts "
                             "sharded over their replicas)")
        if self.ctx.groups.tp_size > 1:
            raise ValueError("checkpoints of ZeRO-1 with tensor parallelism are not supported yet (its optimizer "
                             "state is cut from flat buffers of the TP shards, which the per-parameter boxes do not "
                             "place in the whole tensor): save with zero_stage=0 or 2")
        init_state(self.sharded)
        group = self.ctx.groups.dp_group
        ranks = dp_global_ranks(group)
        model = model_state_dict(self.sharded, get_model_state_dict(modules), group, ranks)
        return model, state_dict(self.sharded, group, ranks)

    def load_checkpoint_dicts(self, modules: nn.Module, model: dict[str, Any], optim: dict[str, Any]) -> None:
        """Take over what the checkpoint read: the model, then the shards' replicated state and hyperparameters
        (the per-element state was read straight into the shards)."""
        strict = StateDictOptions(strict=not self.sharded.own_master)  # qwZ: the flattened weights are elsewhere
        set_model_state_dict(modules, plain_entries(model), options=strict)
        load_state_dict(self.sharded, optim)
        if self.sharded.own_master:  # qwZ: the weights were read into the masters; gather them as the step did
            self.sharded.gather(self.ctx.wait, draw=self.draws - 1, exact=self.draws == 0)

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """qwZ: gather the exact master shards into the parameters (they hold dequantized values), restore after."""
        if not self.sharded.own_master:
            yield
            return
        kept = [p.detach().clone() for p in self.params]
        self.sharded.gather(self.ctx.wait, exact=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(self.params, kept, strict=True):
                    param.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        """The draw counter when anything goes on the wire as int8 (else nothing: the optimizer state is saved
        with the model, per parameter)."""
        return {"draws": self.draws} if quantized(self.ctx) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s draw counter."""
        if set(state) - {"draws"}:
            raise ValueError(f"the zero1 strategy keeps only 'draws', got keys {sorted(state)}")
        self.draws = int(state.get("draws", 0))
