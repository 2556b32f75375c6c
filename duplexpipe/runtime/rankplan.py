"""One rank's plan, derived once from the lowered schedule: its lists, its stages' roles, where gradients are final."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from duplexpipe.runtime.context import forward_only
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.layout import Layout


@dataclass(frozen=True)
class RankPlan:
    """Everything about one rank's part of a schedule that does not change from step to step."""

    layout: Layout
    """The schedule's stage chains: who feeds whom, on which rank (peers and local handoffs)."""
    rank: int
    """This rank."""
    rows: tuple[Action, ...]
    """This rank's lowered list (a training step)."""
    eval_rows: tuple[Action, ...]
    """Its forward-only list (evaluate)."""
    firsts: tuple[int, ...]
    """This rank's stages that read the batch's inputs."""
    lasts: tuple[int, ...]
    """This rank's stages that compute the loss."""
    output_ranks: tuple[int, ...]
    """The ranks holding a last stage, in the batch order of the microbatches they finish."""
    grads_final: dict[int, tuple[int, ...]]
    """Position in `rows` -> the stages whose gradients are final for the step once that action ran
    (their last B or W on this rank); stages in `mirrored` are not listed."""
    mirrored: tuple[int, ...]
    """This rank's stages whose gradients are final only after the end-of-step mirror sum (DualPipe)."""

    @staticmethod
    def of(schedule: Schedule, rank: int, mirrored: Collection[int] = ()) -> RankPlan:
        """The plan of `rank` in the lowered `schedule`."""
        layout = Layout.of(schedule)
        rows = schedule.actions[rank]
        mine = schedule.stages_of_rank(rank)
        last_at: dict[int, int] = {}
        for pos, action in enumerate(rows):
            for part in action.compute_parts():
                if part.op in (Op.B, Op.W):
                    last_at[part.stage] = pos
        final: dict[int, list[int]] = {}
        for stage, pos in sorted(last_at.items()):
            if stage not in mirrored:
                final.setdefault(pos, []).append(stage)
        lasts = [s for s in range(schedule.num_stages) if layout.nxt[s] < 0]
        first_mb: dict[int, int] = {}
        for s in lasts:
            first_mb[layout.rank[s]] = min(first_mb.get(layout.rank[s], layout.lo[s]), layout.lo[s])
        return RankPlan(
            layout=layout, rank=rank, rows=rows, eval_rows=forward_only(rows),
            firsts=tuple(s for s in mine if layout.prv[s] < 0), lasts=tuple(s for s in mine if layout.nxt[s] < 0),
            output_ranks=tuple(sorted(first_mb, key=lambda r: first_mb[r])),
            grads_final={pos: tuple(stages) for pos, stages in final.items()},
            mirrored=tuple(s for s in mine if s in mirrored))
