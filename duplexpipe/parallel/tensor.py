"""Tensor parallelism inside each stage: the plan applied to this rank's stage modules, the gradients that are partial
sums over the TP group summed once a stage's gradients are final, and which gradients the global norm counts here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from duplexpipe.model.stages import PartSource, as_factory, inner_module, model_parts
from duplexpipe.model.tp_plans import (
    SEQUENCE_SHARDS,
    TPPlan,
    check_plan,
    local_bytes,
    parallelize_part,
    partial_modules,
    partial_params,
    plan_errors,
    sharded_over_tp,
    summary,
)
from duplexpipe.moe.balance import moe_layers
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.parallel.tied import TiedGrads
from duplexpipe.parallel.tp_lane import TPCollectives
from duplexpipe.runtime.local_tensors import local_of
from duplexpipe.schedules.timeline import Span

Waiter = Callable[[Any, str], None]
"""wait(work, what): a bounded, failure-aware wait for an async collective."""


def counts_here(p: Tensor, tp_rank: int) -> bool:
    """Whether this TP rank adds `p`'s gradient to the global norm: a shard on every TP rank, a parameter every TP
    rank holds whole (replicated) on TP rank 0 only, so each element counts once."""
    return tp_rank == 0 or sharded_over_tp(p)


def check_tensor_parallel(parts: PartSource, plan: TPPlan | None, groups: ParallelGroups,
                          sequence_parallel: bool) -> None:
    """ValueError on every rank, before any part is built or sharded, for a plan that cannot run on `groups`."""
    tp = groups.tp_size
    if plan is None:
        if tp > 1:
            raise ValueError(f"the mesh has tp={tp} but no tp_plan was given: pass Pipeline(tp_plan=...) (a dict of "
                             "torch ParallelStyles or a callable (part, tp_mesh) -> None)")
        if sequence_parallel:
            raise ValueError("sequence_parallel=True needs tensor parallelism: a mesh with tp > 1 and a tp_plan")
        return
    if tp == 1:
        return  # a plan with tp=1 shards nothing: the model runs whole
    if as_factory(parts) is None:  # parts from a factory: each rank checks its own when it shards them (apply)
        check_plan(list(parts), plan, tp)  # type: ignore[arg-type]


def _anywhere(flag: bool) -> bool:
    """Whether `flag` holds on any rank of the world (collective when initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, flag)
    return any(everyone)


def _is_partial(t: DTensor) -> bool:
    """Whether a DTensor holds partial sums along some mesh dimension."""
    return any(isinstance(x, Partial) for x in t.placements)


def _summed(local: Tensor, grad: DTensor) -> DTensor:
    """The sum of `grad`'s Partial pieces (`local`, already summed over the TP group) in `grad`'s layout, Partial
    become Replicate."""
    placements = [Replicate() if isinstance(x, Partial) else x for x in grad.placements]
    return DTensor.from_local(local, grad.device_mesh, placements, run_check=False, shape=grad.shape,
                              stride=grad.stride())


class TensorParallel:
    """This rank's tensor parallelism: `apply` shards its stage modules with the plan, `grads_final(stage)` sums the
    stage's gradients that are partial over the TP group (sequence parallelism); the global
    norm counts each gradient once (`counts_here`, used by the data-parallel strategies). Inactive (every method a
    no-op) without a plan or with tp=1."""

    def __init__(self, plan: TPPlan | None, groups: ParallelGroups, sequence_parallel: bool) -> None:
        self.plan = plan
        self.groups = groups
        self.sequence_parallel = sequence_parallel
        """Whether activations between TP regions, stage-to-stage messages included, hold 1/TP of the sequence."""
        self.active = plan is not None and groups.tp_size > 1
        """Whether this pipeline shards its stages over a TP group."""
        self.partial: dict[int, list[nn.Module]] = {}
        """stage -> its modules whose plain parameters' gradients are partial sums over TP
        (ReplicatedWithGradAllReduce)."""
        self._pending: set[int] = set()
        self._lane: TPCollectives | None = None

    def apply(self, modules: Mapping[int, nn.Module], zero_stage: int = 0) -> None:
        """Shard every stage module of this rank in place (each TP rank holds the same whole weights and keeps its
        slice); ValueError on every rank for a plan that cannot shard the model or does not fit `zero_stage`."""
        if not self.active:
            return
        assert self.plan is not None and self.groups.tp_mesh is not None
        if isinstance(self.plan, Mapping):
            self._check_everywhere([p for s in sorted(modules) for p in model_parts(modules[s])], self.plan)
        for stage in sorted(modules):
            self.partial[stage] = []
            for part in model_parts(modules[stage]):  # a chain of merged parts (schedule="auto"): each part
                self._check_moe(stage, part)
                for module in part.modules():  # parts that build masks or positions (Hugging Face parts)
                    if hasattr(module, SEQUENCE_SHARDS):
                        setattr(module, SEQUENCE_SHARDS, self.groups.tp_size if self.sequence_parallel else 1)
                parallelize_part(part, self.plan, self.groups.tp_mesh)
                self.partial[stage] += partial_modules(part)
        if zero_stage == 2 and self.groups.dp_size > 1 and _anywhere(any(self.partial.values())):
            raise ValueError("zero_stage=2 with modules whose parameters' gradients are partial over the TP group "
                             "(ReplicatedWithGradAllReduce: Qwen3's q_norm / k_norm, MoE layers under sequence "
                             "parallelism) is not supported: FSDP2 reduce-scatters them over the data-parallel group "
                             "before they are summed over TP; use zero_stage=1")

    def _check_moe(self, stage: int, part: nn.Module) -> None:
        """ValueError for MoE layers whose balance loss cannot be exact under sequence parallelism."""
        coefs = [layer.aux_loss_coef for layer in moe_layers(part) if layer.aux_loss_coef]
        if self.sequence_parallel and coefs:
            raise ValueError(f"stage {stage} holds MoE layers with aux_loss_coef={coefs[0]} under sequence "
                             "parallelism: each TP rank routes only its sequence shard, and the balance loss of a "
                             "shard (a product of its token fractions and mean scores) is not a part of the "
                             "sequence's; use bias_update_speed (loss-free balancing, exact under SP) or "
                             "sequence_parallel=False")

    def _check_everywhere(self, parts: list[nn.Module], plan: Mapping[str, Any]) -> None:
        """The dict plan against every rank's parts (the plan keys some part has, the dimensions it cannot shard),
        shared over the world so that every rank raises the same ValueError before any part is sharded."""
        found, errors = plan_errors(parts, plan, self.groups.tp_size)
        mine: list[Any] = [(sorted(found), errors)]
        everyone = mine
        if dist.is_available() and dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine[0])
        seen = {key for keys, _ in everyone for key in keys}
        problems = list(dict.fromkeys(e for _, errs in everyone for e in errs))
        missing = [key for key in plan if key not in seen]
        if missing:
            problems.insert(0, f"it names module(s) {missing} that no model part has")
        if problems:
            raise ValueError(f"tp_plan cannot shard the model at TP degree {self.groups.tp_size}: "
                             + summary(problems))

    def begin_window(self) -> None:
        """A window's last call starts: every stage's partial gradients wait to be summed."""
        self._pending = set(self.partial) if self.active else set()

    def grads_final(self, stage: int, modules: Mapping[int, nn.Module], wait: Waiter) -> None:
        """Stage `stage`'s gradients are final for the window: sum the partial ones over the TP group (one all-reduce
        of them all) and give every DTensor gradient its parameter's layout (DTensor's backward may leave a Partial
        sum, or a whole gradient of a sharded parameter, e.g. a vocabulary-parallel embedding's)."""
        if stage not in self._pending:
            return
        self._pending.discard(stage)
        params = [p for p in inner_module(modules[stage]).parameters() if p.grad is not None]
        partial = [p for p in params if isinstance(p.grad, DTensor) and _is_partial(p.grad)]
        plain = [p for p in partial_params(self.partial.get(stage, [])) if p.grad is not None]
        if partial or plain:
            flat = torch.cat([local_of(p.grad).reshape(-1) for p in partial + plain])  # type: ignore[arg-type]
            work = dist.all_reduce(flat, group=self.groups.tp_group, async_op=True)
            wait(work, f"the sum over the TP group of stage {stage}'s partial gradients")
            offset = 0
            for p in partial + plain:
                grad = p.grad
                assert grad is not None
                local = local_of(grad)
                summed = flat[offset:offset + local.numel()].view_as(local)
                p.grad = _summed(summed, grad) if isinstance(grad, DTensor) else summed
                offset += local.numel()
        for p in params:
            grad = p.grad
            if isinstance(p, DTensor) and isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                p.grad = grad.redistribute(p.device_mesh, p.placements)

    def finish(self, modules: Mapping[int, nn.Module], wait: Waiter) -> None:
        """Sum the partial gradients of the stages that did not report (before the data-parallel reduction)."""
        for stage in sorted(self._pending):
            self.grads_final(stage, modules, wait)

    def check_tied(self, tied: TiedGrads) -> None:
        """ValueError on every rank when the copies of a tied parameter are sharded differently (their local
        gradients could not be summed); collective over the world when active."""
        if not self.active or not (dist.is_available() and dist.is_initialized()):
            return
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, tied.layouts())
        for index in range(len(tied.layouts())):
            seen = sorted({layout for per_rank in everyone for layout in per_rank[index]})
            if len(seen) > 1:
                raise ValueError(f"tied parameter {index} is sharded differently by the tp_plan in the parts that "
                                 f"use it ({', '.join(seen)}); give every module that uses it the same layout (e.g. "
                                 "a vocabulary-parallel embedding, RowwiseParallel, with a column-parallel head) or "
                                 "untie it")

    @contextlib.contextmanager
    def timed(self, record: bool) -> Iterator[None]:
        """Inside, DTensor's collectives are timed for the "tp" lane (when active and `record`; see tp_lane)."""
        self._lane = TPCollectives() if self.active and record else None
        if self._lane is None:
            yield
            return
        with self._lane:
            yield

    def spans(self, origin: float, rank: int) -> list[Span]:
        """The last timed call's TP collectives on the "tp" lane, relative to `origin` (none when not timed)."""
        return self._lane.spans(origin, rank) if self._lane is not None else []

    def param_bytes(self, modules: Mapping[int, nn.Module]) -> int:
        """Bytes of parameters this rank holds in its stage modules (a sharded parameter's local shard; each
        stage module counted, DualPipe's two copies of a part twice)."""
        return sum(local_bytes(inner_module(m)) for m in modules.values())
