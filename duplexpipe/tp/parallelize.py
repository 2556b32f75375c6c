"""Tensor parallelism inside each stage: the plan applied to this rank's stage modules (checked over the pipeline
group), the gradients that are partial sums over the TP group summed once a stage's gradients are final, and which
gradients the global norm counts here."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from duplexpipe.comm.agreement import any_rank, every_rank_texts
from duplexpipe.comm.local_tensors import local_of
from duplexpipe.runtime.backend import default_device
from duplexpipe.schedules.timeline import Span
from duplexpipe.tp.lane import TPCollectives
from duplexpipe.tp.plans import (
    SEQUENCE_SHARDS,
    Restyle,
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

Waiter = Callable[[Any, str], None]
"""wait(work, what): a bounded, failure-aware wait for an async collective."""


class TPGroups(Protocol):
    """What tensor parallelism needs of this process's groups (`parallel.mesh.ParallelGroups` has it)."""

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group (None: the default group): every model part lies on one of its ranks."""

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas."""

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group (None when tp_size is 1)."""

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree."""

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D "tp" sub-mesh `parallelize_module` shards over (None when tp_size is 1)."""


@runtime_checkable
class SequenceParallelCheck(Protocol):
    """A module that can say why it cannot run under sequence parallelism (an MoE layer with a balance loss)."""

    def sequence_parallel_error(self) -> str | None:
        """What it is and why it cannot run on a sequence shard ("MoE layers with ..."); None when it can."""


def counts_here(p: Tensor, tp_rank: int) -> bool:
    """Whether this TP rank adds `p`'s gradient to the global norm: a shard on every TP rank, a parameter every TP
    rank holds whole (replicated) on TP rank 0 only, so each element counts once."""
    return tp_rank == 0 or sharded_over_tp(p)


def check_tensor_parallel(parts: Sequence[nn.Module] | Callable[[int], nn.Module], plan: TPPlan | None,
                          groups: TPGroups, sequence_parallel: bool) -> None:
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
    if callable(parts) and not isinstance(parts, nn.Module):
        return  # parts from a factory: each rank checks its own when it shards them (apply)
    check_plan(list(parts), plan, tp)  # type: ignore[arg-type]


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

    def __init__(self, plan: TPPlan | None, groups: TPGroups, sequence_parallel: bool,
                 restyle: Restyle | None = None) -> None:
        self.plan = plan
        self.restyle = restyle
        """What each entry of a dict plan applies in place of its style (`tp.plans.Restyle`; None: the plan's own)."""
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

    def apply(self, parts: Mapping[int, Sequence[nn.Module]], zero_stage: int = 0) -> None:
        """Shard the model parts of every stage of this rank in place (stage -> the parts its module runs: several
        for a chain of merged parts, schedule="auto"; each TP rank holds the same whole weights and keeps its
        slice); ValueError on every rank for a plan that cannot shard the model or does not fit `zero_stage`
        (collective over the pipeline group, whose ranks hold every part)."""
        if not self.active:
            return
        assert self.plan is not None and self.groups.tp_mesh is not None
        if isinstance(self.plan, Mapping):
            self._check_everywhere([p for s in sorted(parts) for p in parts[s]], self.plan)
        for stage in sorted(parts):
            self.partial[stage] = []
            for part in parts[stage]:
                self._check_sequence_parallel(stage, part)
                for module in part.modules():  # parts that build masks or positions (Hugging Face parts)
                    if hasattr(module, SEQUENCE_SHARDS):
                        setattr(module, SEQUENCE_SHARDS, self.groups.tp_size if self.sequence_parallel else 1)
                parallelize_part(part, self.plan, self.groups.tp_mesh, self.restyle)
                self.partial[stage] += partial_modules(part)
        if zero_stage == 2 and self.groups.dp_size > 1 and self._any_rank([any(self.partial.values())])[0]:
            raise ValueError("zero_stage=2 with modules whose parameters' gradients are partial over the TP group "
                             "(ReplicatedWithGradAllReduce: Qwen3's q_norm / k_norm, MoE layers under sequence "
                             "parallelism) is not supported: FSDP2 reduce-scatters them over the data-parallel group "
                             "before they are summed over TP; use zero_stage=1")

    def _check_sequence_parallel(self, stage: int, part: nn.Module) -> None:
        """ValueError for modules that cannot run on a sequence shard (MoE layers whose balance loss would not be
        exact) under sequence parallelism."""
        if not self.sequence_parallel:
            return
        for module in part.modules():
            if isinstance(module, SequenceParallelCheck) and (why := module.sequence_parallel_error()):
                raise ValueError(f"stage {stage} holds {why}")

    def _any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Per flag, whether some rank of this pipeline raised it (every pipeline holds the same parts)."""
        return any_rank(flags, self.groups.pp_group, default_device(self.groups.pp_group))

    def _check_everywhere(self, parts: list[nn.Module], plan: Mapping[str, Any]) -> None:
        """The dict plan against every part of the pipeline (the plan keys some part has, the dimensions it cannot
        shard): one all-reduce of flags over the pipeline group, and the ranks' errors gathered over it only when
        something is wrong, so that every rank raises the same ValueError before any part is sharded."""
        found, errors = plan_errors(parts, plan, self.groups.tp_size)
        flags = self._any_rank([key in found for key in plan] + [bool(errors)])
        if all(flags[:-1]) and not flags[-1]:
            return
        everyone = every_rank_texts(errors, self.groups.pp_group, default_device(self.groups.pp_group))
        problems = list(dict.fromkeys(e for errs in everyone for e in errs))
        missing = [key for key, seen in zip(plan, flags[:-1], strict=True) if not seen]
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
        params = [p for p in modules[stage].parameters() if p.grad is not None]
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

    def check_tied(self, layouts: Sequence[Sequence[str]]) -> None:
        """ValueError on every rank when the copies of a tied parameter are sharded differently (their local
        gradients could not be summed); `layouts`: per tied parameter, those of this rank's copies
        (`parallel.tied.TiedGrads.layouts`). Collective over the pipeline group when active and any are tied."""
        if not self.active or not layouts:
            return
        mine = [json.dumps(sorted(set(per_tie))) for per_tie in layouts]
        everyone = every_rank_texts(mine, self.groups.pp_group, default_device(self.groups.pp_group))
        for index in range(len(layouts)):
            seen = sorted({layout for per_rank in everyone for layout in json.loads(per_rank[index])})
            if len(seen) > 1:
                raise ValueError(f"tied parameter {index} is sharded differently by the tp_plan in the parts that "
                                 f"use it ({', '.join(seen)}); give every module that uses it the same layout (e.g. "
                                 "a vocabulary-parallel embedding, RowwiseParallel, with a column-parallel head) or "
                                 "untie it")

    @contextlib.contextmanager
    def timed(self, record: bool) -> Iterator[None]:
        """Inside, DTensor's collectives are timed for the "tp" lane (when active and `record`; see `tp.lane`)."""
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
        return sum(local_bytes(m) for m in modules.values())
