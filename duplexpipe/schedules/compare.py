"""Schedules side by side: simulate several under one cost model into table rows, and the cost convention in words."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.simulate import CostModel, simulate

__all__ = ["compare_rows", "compare_schedules", "cost_note", "with_cost"]


def cost_note(cost: CostModel, schedule: Schedule | None = None) -> str:
    """The cost convention in words: `costs per 1/P of the model: F=1 B=2 W=1 (...)`."""
    values = f"F={cost.f:g} B={cost.b:g} W={cost.w:g}" + ("" if cost.fb is None else f" FB={cost.fb:g}")
    if cost.stage_costs:
        values += f", {len(cost.stage_costs)} stage(s) overridden"
    if cost.comm_time:
        values += f", message time {cost.comm_time:g}"
    if cost.experts.per_pass:
        values += (f", {cost.moe_layers} MoE layer(s) per stage with dispatch {cost.dispatch:g} and combine "
                   f"{cost.combine:g} ({'overlapped' if cost.fb_overlap else 'sequential'} F&B pairs)")
    if not cost.stage_scale:
        return f"costs per stage: {values}"
    note = f"costs per 1/P of the model: {values}"
    if schedule is not None and schedule.num_groups != schedule.num_ranks:
        factor = schedule.num_ranks / schedule.num_groups
        note += (f" (the model is cut into {schedule.num_groups} parts on {schedule.num_ranks} ranks: each stage "
                 f"takes {factor:g}x; --costs-per stage for per-stage costs)")
    return note


def compare_schedules(entries: Sequence[tuple[str, Schedule | str]], cost: CostModel) -> tuple[list[dict[str, Any]],
                                                                                        list[Any]]:
    """Simulate each (label, schedule) under `cost` as given; a (label, reason) entry becomes a skipped row.
    Returns the table rows and the timelines."""
    rows: list[dict[str, Any]] = []
    timelines: list[Any] = []
    for label, schedule in entries:
        if isinstance(schedule, str):
            rows.append({"schedule": label, "skipped": schedule})
            continue
        timeline = simulate(schedule, cost)
        timelines.append(timeline)
        peak = max(timeline.peak_activations(r) for r in range(schedule.num_ranks))
        rows.append({
            "schedule": label, "ranks": schedule.num_ranks, "microbatches": schedule.num_microbatches,
            "makespan": timeline.makespan, "bubble_ratio": timeline.bubble_ratio, "peak_activations": peak,
            "peak_activation_memory": peak * schedule.num_ranks / schedule.num_groups,
            "params_per_rank": registry.params_per_rank(schedule),
        })
    return rows, timelines


def with_cost(name: str, options: dict[str, Any], cost: CostModel | None) -> dict[str, Any]:
    """`options`, plus cost=`cost` when schedule `name`'s registry entry lists "cost" among its options."""
    if cost is None or "cost" not in registry.entry(name).options:
        return options
    return {**options, "cost": cost}


def compare_rows(ranks: int, microbatches: int, cost: CostModel, names: Sequence[str] | None = None,
                 options: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Simulate built-in schedules for P and M under `cost` as given (its stage_scale included): `names`,
    or every schedule (one that rejects P and M becomes a skipped row). Options go to the schedules whose
    registry entry takes them. Returns rows and timelines."""
    entries: list[tuple[str, Schedule | str]] = []
    for name in names or registry.names():
        own = with_cost(name, {k: v for k, v in (options or {}).items() if k in registry.entry(name).options}, cost)
        reason = None if names else registry.check(name, ranks, microbatches, **own)
        entries.append((name, reason if reason is not None else registry.build(name, ranks, microbatches, **own)))
    return compare_schedules(entries, cost)
