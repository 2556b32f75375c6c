"""Tied parameters: one weight held by several model parts, its gradient summed over every copy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from duplexpipe.comm.local_tensors import laid_out_like, local_of
from duplexpipe.model.stages import inner_module
from duplexpipe.parallel.grads import Waiter
from duplexpipe.runtime.backend import default_device
from duplexpipe.schedules.ir import Schedule


@dataclass(frozen=True)
class TiedParam:
    """One Parameter that several model parts hold (e.g. GPT-2's token embedding and output head)."""

    places: tuple[tuple[int, str], ...]
    """(model part, parameter name in that part) of every place it appears, in part order."""

    @property
    def parts(self) -> tuple[int, ...]:
        """The model parts that hold it."""
        return tuple(part for part, _ in self.places)


def find_tied(parts: Sequence[nn.Module]) -> list[TiedParam]:
    """The trainable Parameters that appear in more than one of `parts` (the same object).

    Parts built by a factory (`Pipeline(part_factory, ...)`) cannot share a Parameter object: pass
    no parts for them (a factory that needs tied weights must tie them inside one part).
    """
    where: dict[int, list[tuple[int, str]]] = {}
    for k, part in enumerate(parts):
        for name, param in part.named_parameters():
            if param.requires_grad:
                where.setdefault(id(param), []).append((k, name))
    return [TiedParam(tuple(places)) for places in where.values() if len({k for k, _ in places}) > 1]


@dataclass(frozen=True)
class TiePlan:
    """How one rank treats one tied parameter."""

    copies: tuple[tuple[int, str], ...]
    """(stage, parameter name) of every copy on this rank."""
    contributions: tuple[tuple[int, str], ...]
    """(stage, name) of the copies whose gradient this rank adds to the sum."""
    holders: tuple[int, ...]
    """Pipeline ranks holding a copy (they exchange the sum); empty when every holder can sum alone."""


def plan_tie(tie: TiedParam, schedule: Schedule, rank: int) -> TiePlan:
    """This rank's copies, the gradients it contributes and who exchanges them.

    Each place's gradient is counted once, from the stage holding the first copy of its part
    (DualPipe's second copy already carries the same, mirror-summed gradient). When every holding
    rank has a copy of every part, each sums locally and nothing is exchanged.
    """
    names = dict(tie.places)
    stages = [s for s, info in enumerate(schedule.stages) if info.group in names]
    copies = tuple((s, names[schedule.stages[s].group]) for s in stages if schedule.stages[s].rank == rank)
    holders = sorted({schedule.stages[s].rank for s in stages})
    parts_on = {r: {schedule.stages[s].group for s in stages if schedule.stages[s].rank == r} for r in holders}
    if all(held == set(names) for held in parts_on.values()):
        first: dict[int, tuple[int, str]] = {}
        for s, name in copies:
            first.setdefault(schedule.stages[s].group, (s, name))
        return TiePlan(copies, tuple(first[k] for k in sorted(first)), ())
    owners = [s for s in stages if schedule.copy_of_stage(s) == 0]
    mine = tuple((s, names[schedule.stages[s].group]) for s in owners if schedule.stages[s].rank == rank)
    return TiePlan(copies, mine, tuple(holders))


class TiedGrads:
    """Sums the gradients of tied parameters over all their copies, on every rank that holds one.

    Build it on every rank of every pipeline (collective when gradients must cross ranks: it creates
    one process group per pipeline for the ranks that hold copies). Call `sum_grads` after the
    schedule's steps and before norms, clipping and the optimizer; copies then get equal gradients
    and, from equal starting values, stay equal.
    """

    def __init__(self, ties: Sequence[TiedParam], schedule: Schedule, rank: int,
                 modules: Mapping[int, nn.Module], pp_group: Any = None) -> None:
        self.plans = [plan_tie(t, schedule, rank) for t in ties]
        params = {s: dict(inner_module(m).named_parameters()) for s, m in modules.items()}
        self._copies = [[params[s][n] for s, n in plan.copies] for plan in self.plans]
        self._mine = [[params[s][n] for s, n in plan.contributions] for plan in self.plans]
        pipelines = _pipelines(pp_group) if any(plan.holders for plan in self.plans) else []
        self._groups = [_holder_group(plan.holders, pipelines) if plan.holders else None for plan in self.plans]
        later = {(s, n) for t, plan in zip(ties, self.plans, strict=True) for s, n in plan.copies
                 if schedule.stages[s].group != t.parts[0] or schedule.copy_of_stage(s) != 0}
        self.uncounted = frozenset(id(params[s][n]) for s, n in later)
        """ids of the copies a global gradient norm must skip (each tied weight counts once)."""

    def sum_grads(self, wait: Waiter | None = None) -> None:
        """Give every local copy of each tied parameter the sum of all copies' gradients.

        `wait(work, what)` waits for the all-reduce (e.g. the trainer's bounded, failure-aware wait);
        None waits unbounded.
        """
        for plan, copies, mine, group in zip(self.plans, self._copies, self._mine, self._groups, strict=True):
            if not copies:
                continue
            total = torch.zeros_like(local_of(copies[0]))  # tensor parallelism: every copy is sharded alike
            for p in mine:
                if p.grad is not None:
                    total.add_(local_of(p.grad))
            if group is not None:
                work = dist.all_reduce(total, group=group, async_op=True)
                what = f"the tied-weight gradient all-reduce with pipeline ranks {list(plan.holders)}"
                if wait is None:
                    work.wait()
                else:
                    wait(work, what)
            for p in copies:
                p.grad = laid_out_like(total.clone(), p)

    def layouts(self) -> list[list[str]]:
        """Per tied parameter, the layouts of this rank's copies ("whole", or a DTensor's placements)."""
        return [[str(tuple(p.placements)) if isinstance(p, DTensor) else "whole" for p in copies]
                for copies in self._copies]

    def counted(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """`params` without the copies that a global norm must not count twice."""
        return [p for p in params if id(p) not in self.uncounted]


def _pipelines(pp_group: Any) -> list[tuple[int, ...]]:
    """Every pipeline of the world (its global ranks in pipeline-rank order), sorted: each process's own, learnt
    with one all-gather of fixed-size int tensors over the world (every process calls `new_group` for every group,
    so the world is the group that must agree here)."""
    world = dist.get_world_size()
    if pp_group is None:
        return [tuple(range(world))]
    mine = sorted(dist.get_process_group_ranks(pp_group), key=lambda g: dist.get_group_rank(pp_group, g))
    if len(mine) == world:  # one pipeline: nothing to learn
        return [tuple(mine)]
    device = default_device()
    gathered = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device))
    return sorted({tuple(int(r) for r in p.tolist()) for p in gathered})


def _holder_group(holders: Sequence[int], pipelines: Sequence[Sequence[int]]) -> Any:
    """A process group of the ranks at `holders` (pipeline ranks) of this process's pipeline.

    Every process creates the groups of every pipeline (one per data-parallel and tensor-parallel coordinate), in
    one order.
    """
    me, kept = dist.get_rank(), None
    for pipeline in pipelines:
        members = sorted(pipeline[h] for h in holders)
        group = dist.new_group(members)
        if me in members:
            kept = group
    return kept
