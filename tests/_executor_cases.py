"""Helpers shared by the executor tests: expected peaks and orders, gradient errors, timeline records."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from models import make_parts, rel_err, stage_modules

from duplexpipe.runtime import gather_timeline
from duplexpipe.schedules.ir import Op, Schedule, format_action
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build


def expected_peak(schedule: Schedule, rank: int) -> int:
    """Live activations counted along the rank's list: +1 at F, -1 at B or W."""
    live = peak = 0
    for action in schedule.actions[rank]:
        for part in action.compute_parts():
            if part.op is Op.F:
                live += 1
                peak = max(peak, live)
            elif part.op in (Op.B, Op.W):
                live -= 1
    return peak


def compute_order(schedule: Schedule, rank: int) -> list[str]:
    return [format_action(a) for a in schedule.actions[rank] if a.op.is_compute]


def _grad_errors(schedule: Schedule, modules: dict[int, torch.nn.Module],
                 want: list[list[torch.Tensor]], scale: float = 1.0) -> float:
    errs = [rel_err(p.grad, scale * w) for s, m in modules.items()
            for p, w in zip(m.parameters(), want[schedule.stages[s].group], strict=True)]
    return max(errs)


def _inputs(schedule: Schedule, rank: int, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, Any]:
    stages = schedule.stages_of_rank(rank)
    first = any(schedule.is_first(s) for s in stages)
    last = any(schedule.is_last(s) for s in stages)
    return (batch[0] if first else None), (batch[1] if last else None)


def _timeline_record(schedule: Schedule, rank: int, result: Any, group: Any) -> dict[str, Any]:
    merged = gather_timeline(result.timeline, group)
    seen = Counter((e.rank, format_action(e.action)) for e in merged.events)
    want = Counter((r, format_action(a)) for r, _, a in schedule.iter_actions() if a.op.is_compute)
    mine = [format_action(e.action) for e in merged.rank_events(rank)]
    return {
        "every_action_once": seen == want,
        "in_list_order": mine == compute_order(schedule, rank),
        "measured": (merged.source, merged.unit) == ("measured", "s"),
        "ordered_spans": all(e.start <= e.end for e in merged.events),
        "peak": result.peak_activations,
        "peak_expected": expected_peak(schedule, rank),
        "peak_timeline": merged.peak_activations(rank),
    }


def _attempt(run: Any) -> dict[str, Any]:
    """Run `run()`; describe how it ended and how long it took."""
    start = time.monotonic()
    try:
        run()
        out: dict[str, Any] = {"type": "ran"}
    except Exception as exc:  # noqa: BLE001 - inspected by the tests
        out = {"type": type(exc).__name__, "text": str(exc), "failed_rank": getattr(exc, "failed_rank", None)}
    out["seconds"] = time.monotonic() - start
    return out


Stages = tuple[Schedule, list[torch.nn.Module], dict[int, torch.nn.Module]]


def stage_setup(name: str, num_ranks: int, num_microbatches: int, rank: int, *, seed: int,
                dtype: torch.dtype = torch.float32) -> Stages:
    """The lowered schedule, the model parts (from `seed`) and this rank's stage modules."""
    schedule = lower(build(name, num_ranks, num_microbatches))
    parts = make_parts(schedule.num_groups, seed=seed, dtype=dtype)
    return schedule, parts, stage_modules(schedule, rank, parts)
