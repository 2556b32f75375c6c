"""ZeRO-2 through torch FSDP2: gradients and optimizer state sharded over the data-parallel group.

Each stage module is `fully_shard`-ed over a 1-D data-parallel mesh with reshard_after_forward=False (with hpZ,
given the post-forward mesh reshard_after_forward=k builds, its groups made by the whole job), so its parameters are
gathered once per step, at its first forward. While the schedule runs, FSDP's gradient sync is off (gradients
accumulate unsharded, so the runtime's I/W split and DualPipe's mirror sum see ordinary tensors); once a stage's
gradients are final the strategy drives FSDP's post-backward by hand, as torch.distributed.pipelining's stage.py
does, which reduce-scatters them and reshards the parameters. FSDP's collectives go through this module's
ReduceScatter / AllGather, which post them on duplexpipe.comm's ShardComm (exact, bf16/fp16, int8 qgZ / qwZ;
metered) and wait with the trainer's bounded wait. Routed MoE experts (expert parallelism) are their own FSDP units:
each MoE layer's `experts` is `fully_shard`-ed over its expert-data-parallel group (the replicas holding the same
experts), nested in its stage's unit, gathered at the layer's first forward of a step (or with its stage, ZeRO-3)
and reduce-scattered with its stage (hpZ's node-local partition is the dense parameters' only); with one replica
per expert (ep == dp) there is nothing to shard them over and they stay whole, reduced as in every strategy
(`DPStrategy._finish_experts`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from duplexpipe.comm import Waitable
from duplexpipe.comm.local_tensors import local_of
from duplexpipe.comm.sharded import Pending, ShardComm
from duplexpipe.dp_options.zero import gradient_wire
from duplexpipe.moe.balance import moe_layers
from duplexpipe.parallel import grads
from duplexpipe.parallel.buckets import BucketSpec, BucketTracker
from duplexpipe.parallel.local_shards import LocalShards
from duplexpipe.parallel.strategy import DPStrategy, StrategyContext
from duplexpipe.parallel.zero1 import counted_stages, quantized
from duplexpipe.parallel.zero_config import check_hpz
from duplexpipe.runtime.backward.compat import foreach_mul_, fsdp_records, give_post_forward_mesh, post_forward_mesh
from duplexpipe.tp.parallelize import counts_here

try:  # FSDP2's public entry point and its (not yet public) custom-collective interfaces
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - torch < 2.6
    FSDPModule = fully_shard = None  # type: ignore[assignment,misc]
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]


class _Comms:
    """One ShardComm per process group FSDP hands over (hpZ gathers inside a node's group), and the
    reduce-scatters left in flight until the strategy finishes them."""

    def __init__(self, strategy: Zero2Strategy) -> None:
        self.strategy = strategy
        self._by_group: dict[Any, ShardComm] = {}
        self.pending: list[Pending] = []
        self.unsegmented = 0
        """Collectives whose chunk did not match the parameters' shards (their int8 blocks run across)."""
        self.gathers: Counter[int] = Counter()
        """Parameter all-gathers posted, by stage (since construction; its experts' apart, `expert_gathers`)."""
        self.gathers_over: Counter[tuple[int, int]] = Counter()
        """Stage parameter all-gathers posted, by (stage, ranks of the group): hpZ's node-local ones have hpz_ranks."""
        self.scatters: Counter[int] = Counter()
        """Gradient reduce-scatters posted, by stage (since construction; its experts' apart, `expert_scatters`)."""
        self.expert_gathers: Counter[int] = Counter()
        """All-gathers of routed experts sharded over their expert-data-parallel group, by stage."""
        self.expert_scatters: Counter[int] = Counter()
        """Reduce-scatters of those experts' gradients, by stage."""
        self.gathering: dict[int, list[Pending]] = {}
        """Stage -> its all-gathers left in flight (ZeRO-3's UNSHARD: its unit's and its experts'), finished
        before FSDP copies them out."""
        self.defer_gathers = False
        """Whether all-gathers may stay in flight (in `gathering`) instead of finishing at once."""

    def segments(self, module: Any, chunk: int, size: int, gathering: bool) -> list[list[int]] | None:
        """segments() of `module`, counting the chunks it cannot cut."""
        cut = segments(module, chunk, size, gathering)
        self.unsegmented += cut is None
        return cut

    def on(self, group: Any) -> ShardComm:
        """The ShardComm of `group`. qwZ quantizes only the gathers over the whole data-parallel group: hpZ's
        node-local ones gather the secondary shards exact (they hold weights dequantized once already; quantizing
        them again in other blocks would give a later episode other weights than the first)."""
        comm = self._by_group.get(group)
        if comm is None:
            ctx = self.strategy.ctx
            whole = dist.get_world_size(group) == ctx.groups.dp_size
            comm = ShardComm(group, self.strategy.meter, gradients=gradient_wire(2, ctx.zero, ctx.compression),
                             weights=ctx.zero.weight_wire if whole else None)
            self._by_group[group] = comm
        return comm


def _unit_params(unit: Any) -> list[nn.Parameter]:
    """The (sharded) parameters of a fully_shard-ed unit, a group of modules included."""
    return [r.sharded_param for r in fsdp_records(unit)]


def segments(module: Any, chunk: int, size: int, gathering: bool) -> list[list[int]] | None:
    """Per rank, the lengths of the parameters' pieces in FSDP's flat chunk of `chunk` elements (the same on
    every rank: FSDP pads each parameter's dim 0 alike), so int8 blocks stay inside one parameter; None when
    they do not add up to the chunk (then the blocks run across the chunk)."""
    lengths = []
    for p in fsdp_records(module):
        if gathering and p.sharded_state.name == "SHARDED_POST_FORWARD":  # hpZ: the node-local shard
            lengths.append(p._sharded_post_forward_param_data.numel())
        else:
            lengths.append(p.padded_sharded_param_size.numel())
    return [lengths] * size if sum(lengths) == chunk else None


class _ReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP's reduce-scatter: posted, and finished by the strategy (or at once when FSDP would accumulate into
    an existing sharded gradient right away). It leaves the mean over the group (ShardComm's contract) in every
    dtype: FSDP is told to divide by 1 and to ask for a plain SUM (see no_fsdp_division), so it scales nothing
    itself (with its defaults it asks AVG in fp32/bf16 but pre-divides and sums in float64/fp16)."""

    def __init__(self, comms: _Comms, stage: int, module: Any, experts: bool = False) -> None:
        self.comms, self.stage, self.module = comms, stage, module
        self.counts, self.what = ((comms.expert_scatters, f"the expert gradients of stage {stage}") if experts
                                  else (comms.scatters, f"the gradients of stage {stage}"))

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"ZeRO-2 told FSDP to leave the division to its reduce-scatter (ReduceOp.SUM), "
                             f"got {op}")
        strategy, comm = self.comms.strategy, self.comms.on(group)
        cut = self.comms.segments(self.module, output_tensor.numel(), comm.size, gathering=False)
        draw = strategy.draws * 4096 + self.stage + (strategy.reductions[self.stage] << 40)  # distinct per episode
        pending = comm.reduce_scatter(input_tensor, output_tensor, self.what, draw=draw, segments=cut)
        self.counts[self.stage] += 1
        if strategy.defer:
            self.comms.pending.append(pending)
        else:
            pending.finish(strategy.ctx.wait)
        return None


class _AllGather(AllGather):  # type: ignore[misc,valid-type]
    """FSDP's parameter all-gather, finished before FSDP copies the parameters out."""

    def __init__(self, comms: _Comms, stage: int, module: Any, experts: bool = False) -> None:
        self.comms, self.stage, self.module = comms, stage, module
        self.counts, self.what = ((comms.expert_gathers, f"the expert parameters of stage {stage}") if experts
                                  else (comms.gathers, f"the parameters of stage {stage}"))

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False) -> Any:
        strategy = self.comms.strategy
        if strategy.ctx.zero.weight_wire is not None and not input_tensor.is_floating_point():
            raise ValueError(f"qwZ needs floating-point parameters; stage {self.stage} gathers {input_tensor.dtype}")
        comm = self.comms.on(group)
        cut = self.comms.segments(self.module, input_tensor.numel(), comm.size, gathering=True)
        pending = comm.all_gather(output_tensor, input_tensor, self.what,
                                  draw=strategy.draws * 4096 + self.stage, segments=cut)
        self.counts[self.stage] += 1
        if self.counts is self.comms.gathers:
            self.comms.gathers_over[self.stage, comm.size] += 1
        if self.comms.defer_gathers:
            self.comms.gathering.setdefault(self.stage, []).append(pending)
        else:
            pending.finish(strategy.ctx.wait)
        return None


def no_fsdp_division(module: Any) -> None:
    """Make FSDP hand the unscaled gradients to the custom reduce-scatter as a SUM and divide nothing after it
    (ShardComm computes the mean, in the gradients' dtype or the compression's; float64 stays exact)."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def reduce_now(module: Any, reshard: bool = True) -> None:
    """Run FSDP's post-backward for `module` now: reduce-scatter its gradients (added into the sharded gradients
    where they exist; the unsharded ones are dropped) and, with `reshard`, reshard its parameters."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(reshard)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined,union-attr]
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def sync_off(module: Any) -> None:
    """Keep gradients unsharded and parameters gathered through the schedule's backward passes."""
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)


def _own_views(module: Any, args: Any, output: Any) -> Any:
    """A forward hook run before FSDP's post-forward: a stage output that is a view (a Linear over 3-D input
    returns one) becomes its own tensor, so FSDP's pre-backward hook on it cannot be lost to an in-place op
    on the view (FSDP warns about every such output)."""
    if isinstance(output, Tensor):
        return output.clone() if output._base is not None and output.requires_grad else output
    if isinstance(output, (tuple, list)):
        return type(output)(_own_views(module, args, o) for o in output)
    if isinstance(output, dict):
        return {k: _own_views(module, args, v) for k, v in output.items()}
    return output


class Zero2Strategy(DPStrategy):
    """Gradients and optimizer states sharded (FSDP2 over the data-parallel group); parameters are gathered
    once per step and resharded when the step's gradients are reduced."""

    name = "zero2"

    def __init__(self, ctx: StrategyContext) -> None:
        if fully_shard is None:
            raise ValueError(f"zero_stage=2 needs torch FSDP2 (torch >= 2.6), this is torch {torch.__version__}")
        check_hpz(ctx.zero, ctx.schedule, ctx.groups.dp_size, ctx.zero_stage)
        self.draws = 0
        """Applied steps: keys the random draws of stochastic int8 rounding (restored with the checkpoint)."""
        self.defer = False
        """Whether reduce-scatters may stay in flight until finish() (no sharded gradient to accumulate into)."""
        self.reductions: Counter[int] = Counter()
        """Stage -> its gradient reductions so far in this accumulation window before the current one (ZeRO-3 with
        a window reduces a stage after each episode; keys qgZ's rounding draws apart)."""
        self.comms = _Comms(self)
        if ctx.groups.dp_group is None:
            raise ValueError(f"zero_stage={ctx.zero_stage} needs a data-parallel group (a mesh with a 'dp' dimension "
                             "of size >= 2)")
        mesh = DeviceMesh.from_group(ctx.groups.dp_group, ctx.device.type)
        if ctx.groups.tp_size > 1:  # FSDP2 composes with TP over the "dp" dimension of the TP parameters' own mesh
            if ctx.groups.dp_mesh is None:
                raise ValueError(f"zero_stage={ctx.zero_stage} with tensor parallelism needs a ('pp', 'dp', 'tp') "
                                 "mesh from make_mesh(pp, dp, tp=...) (FSDP2 shards over its 'dp' dimension)")
            if ctx.zero.hpz_ranks:
                raise ValueError(f"ZeroOptions(hpz_ranks={ctx.zero.hpz_ranks}) with tensor parallelism is not "
                                 "supported (FSDP2 cannot reshard TP's DTensor parameters to the node-local mesh); use "
                                 "hpz_ranks=None")
            mesh = ctx.groups.dp_mesh
        secondary = post_forward_mesh(mesh, ctx.zero.hpz_ranks) if ctx.zero.hpz_ranks else None
        self.expert_units: dict[int, list[Any]] = {}
        """Stage -> its MoE layers' `experts` modules, each an FSDP unit over the expert-data-parallel group (none
        with one replica per expert: those experts stay whole, outside FSDP)."""
        edp_mesh = (DeviceMesh.from_group(ctx.groups.edp_group, ctx.device.type)
                    if ctx.experts and ctx.groups.edp_group is not None and ctx.groups.edp_size > 1 else None)
        for stage, module in sorted(ctx.modules.items()):
            experts = {p for p in module.parameters() if id(p) in ctx.experts}
            if edp_mesh is not None and experts:
                self.expert_units[stage] = self._shard_experts(stage, module, edp_mesh)
                experts = set()  # FSDP leaves the nested units' parameters to them
            fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=experts or None)
            if secondary is not None:  # hpZ: reshard_after_forward=k's mesh, its groups made by the whole job
                give_post_forward_mesh(module, secondary)
            module.set_custom_reduce_scatter(_ReduceScatter(self.comms, stage, module))  # type: ignore[operator]
            module.set_custom_all_gather(_AllGather(self.comms, stage, module))  # type: ignore[operator]
            no_fsdp_division(module)
            module.register_forward_hook(_own_views, prepend=True)
        if self.expert_units:  # FSDP's sharded DTensors replace the experts' parameters
            ctx = replace(ctx, experts=frozenset(id(p) for units in self.expert_units.values() for u in units
                                                 for p in _unit_params(u)))
        super().__init__(ctx)  # the parameters are FSDP's sharded DTensors from here on
        order = [s for s in ctx.final_order if s in ctx.modules] + sorted(set(ctx.modules) - set(ctx.final_order))
        self.buckets = [BucketSpec(i, tuple(p for p in ctx.modules[s].parameters() if id(p) not in ctx.experts),
                                   frozenset({s})) for i, s in enumerate(order)]
        self.tracker = BucketTracker(self.buckets)

    def _shard_experts(self, stage: int, module: nn.Module, mesh: DeviceMesh) -> list[Any]:
        """fully_shard each MoE layer's routed experts in `module` together (one unit per layer: one all-gather and
        one reduce-scatter) over the expert-data-parallel `mesh`; FSDP gathers them at the first expert's forward
        (once, until they are resharded; under ZeRO-3 the stage's UNSHARD has). Returns each unit's first expert
        (FSDPModule's methods on any module of a group act on the group)."""
        units = []
        for layer in moe_layers(module):
            experts = list(layer.experts.values())
            fully_shard(experts, mesh=mesh, reshard_after_forward=False)
            unit = experts[0]
            unit.set_custom_reduce_scatter(_ReduceScatter(self.comms, stage, unit, experts=True))  # type: ignore[operator]
            unit.set_custom_all_gather(_AllGather(self.comms, stage, unit, experts=True))  # type: ignore[operator]
            no_fsdp_division(unit)
            units.append(unit)
        return units

    @property
    def units(self) -> list[Any]:
        """Every FSDP unit of this rank: the stage modules, then the expert units."""
        return [*self.ctx.modules.values(), *(u for units in self.expert_units.values() for u in units)]

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The factory's optimizer over plain aliases of the parameters' local shards (see local_shards)."""
        self.shards = LocalShards(self.params)
        return self.ctx.optimizer_factory(self.shards.shards)

    def zero_grad(self) -> None:
        """Drop the gradients of the parameters and of their shards."""
        self.shards.clear_grads()
        self.reductions.clear()

    def begin_call(self, final: bool, divisor: float) -> None:
        """Turn FSDP's gradient sync off for the schedule (the strategy reduces each stage itself)."""
        super().begin_call(final, divisor)
        for module in self.ctx.modules.values():
            sync_off(module)

    def start_bucket(self, spec: BucketSpec) -> Waitable | None:
        """Reduce-scatter one stage's gradients through FSDP's post-backward."""
        (stage,) = spec.stages
        return self.reduce_stage(stage, reshard=True)

    def reduce_stage(self, stage: int, reshard: bool) -> Waitable | None:
        """Reduce-scatter `stage`'s gradients (and its expert units') through FSDP's post-backward, left in flight
        when no sharded gradient exists yet; else FSDP adds the result into it, so the sums still in flight finish
        first. Returns the first collective started (to time it) or None."""
        held = [r.sharded_param for unit in self._stage_units(stage) for r in fsdp_records(unit)]
        self.defer = all(p.grad is None for p in held)
        if not self.defer:
            self.finish_buckets()
        first = len(self.comms.pending)
        try:
            reduce_now(self.ctx.modules[stage], reshard)
        finally:
            self.defer = False
            self.reductions[stage] += 1
        started = self.comms.pending[first:]
        return started[0].work if started else None

    def _stage_units(self, stage: int) -> list[Any]:
        """`stage`'s FSDP units: its module, then its expert units."""
        return [self.ctx.modules[stage], *self.expert_units.get(stage, [])]

    def finish_buckets(self) -> None:
        """Wait for the reduce-scatters still in flight (their results are FSDP's sharded gradients)."""
        pending, self.comms.pending = self.comms.pending, []
        for each in pending:
            each.finish(self.ctx.wait)

    def local_grads(self, stages: list[int] | None = None, counted: bool = False) -> list[Tensor]:
        """This rank's shards of the reduced gradients (of `stages`, or all; `counted`: only those this TP rank adds
        to the norm, `tensor.counts_here`)."""
        mods, groups, experts = self.ctx.modules, self.ctx.groups, self.ctx.experts
        keep = sorted(mods) if stages is None else stages
        # whole experts: counted on the first expert-data-parallel replica only; sharded ones: each its shard
        experts_here = bool(self.expert_units) or groups.dp_rank < groups.ep_size
        return [local_of(p.grad) for s in keep for p in mods[s].parameters() if p.grad is not None
                and (not counted or (counts_here(p, groups.tp_rank) and (id(p) not in experts or experts_here)))]

    def checked_grads(self) -> list[Tensor]:
        """The gradient shards (an inf/NaN anywhere in a sum lands in its owner's shard)."""
        return self.local_grads()

    def norm_and_overflow(self, need: bool) -> tuple[float | None, bool]:
        """Every data-parallel rank counts its own shards of the first copies (each element once)."""
        if not need:
            return None, False
        raw, overflow = grads.global_norm_and_overflow(
            self.local_grads(counted_stages(self.ctx), counted=True), self.checked_grads(), None, self.ctx.device,
            count_here=True, wait=self.ctx.wait, flagged=self.local_overflow())
        return raw / self.post_divisor, overflow

    def step(self, clip_coef: float) -> None:
        """Scale the gradient shards by clip_coef / post_divisor and step the sharded parameters."""
        factor = clip_coef / self.post_divisor
        if factor != 1.0:
            foreach_mul_(self.local_grads(), factor)
        self.shards.take_grads()
        self.optimizer.step()
        self.draws += 1
        self.end_step(applied=True)

    def _finish_experts(self) -> None:
        """Sharded experts: their reduce-scatter left each shard the mean over the expert-data-parallel group;
        bring it to the dense gradients' units (the sum over that group divided by the data-parallel size, scaled
        by post_divisor / divisor). Whole experts: as every strategy (an all-reduce over that group)."""
        if not self.expert_units:
            super()._finish_experts()
            return
        if not self.expert_params or not self.final:
            return
        found = grads.ensure_grads(self.expert_params)
        groups = self.ctx.groups
        factor = self.post_divisor * groups.edp_size / (self.divisor * groups.dp_size)
        if factor != 1.0:
            foreach_mul_(found, factor)

    def reshard(self) -> None:
        """Put every stage module and expert unit back in its sharded state (e.g. after an evaluation, before a
        checkpoint)."""
        for module in self.units:
            if isinstance(module, FSDPModule):
                module.reshard()

    def checkpoint_dicts(self, modules: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Sharded (DTensor) model and optimizer state per parameter, from the resharded modules."""
        if self.expert_params and not self.expert_units:
            raise ValueError(f"checkpoints of zero_stage={self.ctx.zero_stage} with MoE experts are not supported yet "
                             "where each expert has one replica (ep == dp: they stay whole on their expert-parallel "
                             "ranks): save with zero_stage=0")
        self.reshard()
        with self.shards.as_dtensors(self.optimizer):
            return super().checkpoint_dicts(modules)

    def load_checkpoint_dicts(self, modules: Any, model: dict[str, Any], optim: dict[str, Any]) -> None:
        """Load the dicts into the DTensor view of the optimizer (the shards keep what was loaded)."""
        with self.shards.as_dtensors(self.optimizer):
            super().load_checkpoint_dicts(modules, model, optim)

    def state_dict(self) -> dict[str, Any]:
        """The draw counter when anything goes on the wire as int8 (the state is saved per parameter)."""
        return {"draws": self.draws} if quantized(self.ctx) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s draw counter."""
        if set(state) - {"draws"}:
            raise ValueError(f"the zero2 strategy keeps only 'draws', got keys {sorted(state)}")
        self.draws = int(state.get("draws", 0))
