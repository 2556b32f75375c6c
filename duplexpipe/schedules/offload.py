"""Which forwards' saved tensors one rank's list holds in host memory, and when: decided from the list alone
(torch-free: the runtime runs the plan, the planner prices it over a simulated timeline)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from duplexpipe.schedules.ir import Action, Op

Key = tuple[int, int]
"""(stage, microbatch)."""


@dataclass(frozen=True)
class OffloadPlan:
    """When one rank's list moves which forwards' saved tensors: decided from the list alone, before the step."""

    offload_after: dict[int, tuple[Key, ...]]
    """Position -> the forwards whose saved tensors go to host right after that action (the end of their F, or the
    end of a later F that made them the furthest)."""
    prefetch_after: dict[int, tuple[Key, ...]]
    """Position -> the forwards whose saved tensors come back right after that action: before the compute action
    preceding their B or I, so the copy overlaps it."""

    @property
    def moves(self) -> int:
        """How many forwards are offloaded per step."""
        return sum(len(keys) for keys in self.offload_after.values())


def offload_plan(actions: Sequence[Action], policy: bool | float) -> OffloadPlan:
    """The plan of a list: after each action that ends forwards, the live forwards (F done, B or I not started) are
    ranked by how far their B or I is; the furthest `policy` of them (True: all but the nearest; a fraction f:
    floor(f x live)) are held on host, each newly chosen one offloaded then. A forward is offloaded only when at least
    one compute action runs while it is away (between this action and the one its prefetch precedes); it stays on
    host until its prefetch, one compute action before its B or I, and stays on the device from there to its B or W
    (what W needs is kept from I on)."""
    due: dict[Key, int] = {}
    for pos, action in enumerate(actions):
        for part in action.compute_parts():
            if part.op in (Op.B, Op.I):
                due[(part.stage, part.microbatch)] = pos
    computes = [pos for pos, a in enumerate(actions) if a.op.is_compute]
    before = {pos: computes[i - 1] if i else -1 for i, pos in enumerate(computes)}
    """Compute position -> the compute position before it (-1: none)."""
    live: dict[Key, int] = {}
    away: set[Key] = set()
    offload: dict[int, list[Key]] = {}
    prefetch: dict[int, list[Key]] = {}
    for pos, action in enumerate(actions):
        produced = False
        for part in action.compute_parts():
            key = (part.stage, part.microbatch)
            if part.op in (Op.B, Op.I):
                live.pop(key, None)
                away.discard(key)
            elif part.op is Op.F and key in due:
                live[key] = due[key]
                produced = True
        if not produced:
            continue
        wanted = len(live) - 1 if policy is True else math.floor(float(policy) * len(live))
        chosen = [k for k in sorted(live, key=live.__getitem__, reverse=True)
                  if k in away or before.get(before[live[k]], -1) > pos][:wanted]
        for key in chosen:
            if key not in away:
                away.add(key)
                offload.setdefault(pos, []).append(key)
                prefetch.setdefault(before[live[key]] - 1, []).append(key)
    return OffloadPlan({p: tuple(k) for p, k in offload.items()}, {p: tuple(k) for p, k in prefetch.items()})
