"""Solve the runtime's per-action, per-message and per-step work and the compute scale from per-rank CPU time."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from duplexpipe.planner.profile import PartProfile, RuntimeOverhead
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.lower import lower


@dataclass(frozen=True)
class OverheadSample:
    """One rank's measured CPU work in one step of a calibration schedule."""

    actions: int
    """Compute actions in the rank's list (an F&B pair counts once)."""
    messages: int
    """SEND and RECV actions in the rank's (lowered) list."""
    seconds: float
    """Its CPU seconds for the step (everything the process did: parts, runtime, optimizer)."""
    compute: float = 0.0
    """Its parts' profiled compute for the step (`rank_work` without overhead)."""


def rank_counts(schedule: Schedule) -> list[tuple[int, int]]:
    """Per rank of `schedule` (lowered first): (compute actions, SEND + RECV actions)."""
    out = []
    for row in lower(schedule).actions:
        messages = sum(a.op.is_comm for a in row)
        out.append((len(row) - messages, messages))
    return out


def rank_work(schedule: Schedule, groups: Sequence[PartProfile], overhead: RuntimeOverhead | None = None
              ) -> list[float]:
    """Per rank: the CPU seconds the model charges it for one step of `schedule` (lowered): its actions
    priced by `groups` (one PartProfile per model part, at the step's microbatch: F, fused B or I + W, I,
    W) times `overhead.compute_scale`, plus `overhead` per compute action, per SEND/RECV and per step."""
    if len(groups) != schedule.num_groups:
        raise ValueError(f"{schedule.name!r} has {schedule.num_groups} model parts, got {len(groups)} part profiles")
    over = overhead or RuntimeOverhead(0.0, 0.0, 0.0)
    prices = [{Op.F: g.forward_s, Op.B: g.full_backward_s, Op.I: g.backward_input_s, Op.W: g.backward_weight_s}
              for g in groups]
    out = []
    for rank, (actions, messages) in enumerate(rank_counts(schedule)):
        compute = 0.0
        for action in schedule.actions[rank]:
            for part in action.compute_parts():
                compute += prices[schedule.stages[part.stage].group].get(part.op, 0.0)
        out.append(over.step_s + actions * over.action_s + messages * over.message_s + over.compute_scale * compute)
    return out


def solve_overhead(samples: Sequence[OverheadSample], method: str = "", fit_scale: bool = False) -> RuntimeOverhead:
    """The non-negative terms whose seconds = alpha x compute + actions x action_s + messages x
    message_s + step_s fits `samples` best in least squares.

    fit_scale=False (a calibration with 1-weight parts): alpha is 1, the samples' compute is
    subtracted. fit_scale=True (a calibration with the real parts): alpha is fitted too and
    returned as `compute_scale` (in-pipeline compute over the profiled compute).
    Needs samples whose columns are not on one plane (e.g. the ranks of 1F1B, whose inner ranks
    exchange twice the messages, at two M; with fit_scale, ranks whose parts cost differently);
    raises ValueError otherwise, or when a sample is malformed.
    """
    for s in samples:
        if s.actions < 0 or s.messages < 0 or not math.isfinite(s.seconds) or not 0 <= s.compute < math.inf:
            raise ValueError(f"bad overhead sample {s}: counts and compute must be >= 0 and seconds finite")
    rows = [[1.0, float(s.actions), float(s.messages)] + ([s.compute] if fit_scale else []) for s in samples]
    y = [s.seconds - (0.0 if fit_scale else s.compute) for s in samples]
    if not rows or _least_squares(rows, y) is None:
        terms = "per-step, per-action, per-message work and the compute scale" if fit_scale else \
            "per-step, per-action and per-message work"
        raise ValueError(f"cannot separate {terms} from {len(samples)} samples: their columns are on one "
                         "plane (measure the ranks of 1F1B at two microbatch counts)")
    full = _nonnegative_fit(rows, y)
    scale = full[3] if fit_scale else 1.0
    if scale <= 0:
        raise ValueError(f"the fitted compute scale is {scale!r}: the samples' CPU time does not grow with their "
                         "compute (measure schedules whose ranks' parts cost differently)")
    return RuntimeOverhead(full[1], full[2], full[0], method, scale)


def _nonnegative_fit(rows: list[list[float]], y: list[float]) -> list[float]:
    """The least-squares coefficients with every one >= 0: the best fit over the subsets of free columns
    (the others held at 0) whose unconstrained solution is non-negative."""
    n = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for free in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(n, 0, -1)):
        coef = _least_squares([[r[j] for j in free] for r in rows], y)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0] * n
        for j, c in zip(free, coef, strict=True):
            full[j] = c
        error = sum((sum(a * b for a, b in zip(r, full, strict=True)) - t) ** 2 for r, t in zip(rows, y, strict=True))
        if best is None or error < best[0]:
            best = (error, full)
    return best[1] if best is not None else [0.0] * n


def _least_squares(rows: list[list[float]], y: list[float]) -> list[float] | None:
    """Solve the normal equations (None when singular)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * t for r, t in zip(rows, y, strict=True))]
         for i in range(n)]
    return _eliminate(a)


def _eliminate(a: list[list[float]]) -> list[float] | None:
    """Gauss-Jordan with partial pivoting on the augmented matrix `a` (changed in place)."""
    n = len(a)
    scale = max((abs(v) for row in a for v in row[:n]), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * p for x, p in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]
