"""One rank's plan, derived once from the lowered schedule: its lists, its stages' roles, where gradients are final."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.layout import Layout


@dataclass(frozen=True)
class RankPlan:
    """Everything about one rank's part of a schedule that does not change from step to step."""

    layout: Layout
    """The schedule's stage chains: who feeds whom, on which rank (peers and local handoffs)."""
    rank: int
    """This rank."""
    actions: tuple[Action, ...]
    """This rank's lowered list of actions (a training step)."""
    eval_actions: tuple[Action, ...]
    """Its forward-only list (evaluate)."""
    firsts: tuple[int, ...]
    """This rank's stages that read the batch's inputs."""
    lasts: tuple[int, ...]
    """This rank's stages that compute the loss."""
    output_ranks: tuple[int, ...]
    """The ranks holding a last stage, in the batch order of the microbatches they finish."""
    grads_final: dict[int, tuple[int, ...]]
    """Position in `actions` -> the stages whose gradients are final for the step once that action ran
    (their last B or W on this rank); stages in `mirrored` are not listed."""
    mirrored: tuple[int, ...]
    """This rank's stages whose gradients are final only after the end-of-step mirror sum (DualPipe)."""
    losses_final: int | None
    """Position in `actions` after which this rank has computed all its losses (its last F of a last stage):
    where it posts its share of the loss sum (`LossSum.post_after`); None when it computes none."""
    eval_losses_final: int | None
    """The same in `eval_actions`."""

    @staticmethod
    def of(schedule: Schedule, rank: int, mirrored: Collection[int] = ()) -> RankPlan:
        """The plan of `rank` in the lowered `schedule`."""
        layout = Layout.of(schedule)
        actions = schedule.actions[rank]
        eval_actions = forward_only(actions)
        mine = schedule.stages_of_rank(rank)
        lasts = [s for s in range(schedule.num_stages) if layout.nxt[s] < 0]
        first_mb: dict[int, int] = {}
        for s in lasts:
            first_mb[layout.rank[s]] = min(first_mb.get(layout.rank[s], layout.lo[s]), layout.lo[s])
        return RankPlan(
            layout=layout, rank=rank, actions=actions, eval_actions=eval_actions,
            firsts=tuple(s for s in mine if layout.prv[s] < 0), lasts=tuple(s for s in mine if layout.nxt[s] < 0),
            output_ranks=tuple(sorted(first_mb, key=lambda r: first_mb[r])),
            grads_final=_grads_final(actions, mirrored), mirrored=tuple(s for s in mine if s in mirrored),
            losses_final=_last_loss(actions, layout), eval_losses_final=_last_loss(eval_actions, layout))

    def hoisted(self, depth: int) -> RankPlan:
        """This plan with every receive moved up to when the receive `depth` places before it from the same
        peer is listed (the first `depth` receives from each peer: to the start of the list; depth <= 0:
        every receive at the start). Receives from one peer keep their order, and posting a receive earlier
        blocks nothing, so the lists stay deadlock-free where receives do not block a stream (gloo)."""
        actions = hoist_receives(self.actions, self.layout, depth)
        eval_actions = hoist_receives(self.eval_actions, self.layout, depth)
        return replace(self, actions=actions, eval_actions=eval_actions,
                       grads_final=_grads_final(actions, self.mirrored), losses_final=_last_loss(actions, self.layout),
                       eval_losses_final=_last_loss(eval_actions, self.layout))


RECEIVES = (Op.RECV_F, Op.RECV_B)
"""The receive operations."""


def hoist_receives(actions: tuple[Action, ...], layout: Layout, depth: int) -> tuple[Action, ...]:
    """`actions` with each receive listed where the receive `depth` places earlier from the same peer was (see
    RankPlan.hoisted); the other actions keep their order."""
    seen: dict[int, list[int]] = {}
    before: dict[int, list[Action]] = {}
    for pos, action in enumerate(actions):
        if action.op not in RECEIVES:
            continue
        feeder = layout.prv[action.stage] if action.op is Op.RECV_F else layout.nxt[action.stage]
        earlier = seen.setdefault(layout.rank[feeder], [])
        at = 0 if depth <= 0 or len(earlier) < depth else earlier[len(earlier) - depth]
        before.setdefault(at, []).append(action)
        earlier.append(pos)
    out: list[Action] = []
    for pos, action in enumerate(actions):
        out.extend(before.get(pos, ()))
        if action.op not in RECEIVES:
            out.append(action)
    return tuple(out)


def _grads_final(actions: tuple[Action, ...], mirrored: Collection[int]) -> dict[int, tuple[int, ...]]:
    """Position in `actions` -> the stages (not in `mirrored`) whose last B or W on this rank it is."""
    last_at: dict[int, int] = {}
    for pos, action in enumerate(actions):
        for part in action.compute_parts():
            if part.op in (Op.B, Op.W):
                last_at[part.stage] = pos
    final: dict[int, list[int]] = {}
    for stage, pos in sorted(last_at.items()):
        if stage not in mirrored:
            final.setdefault(pos, []).append(stage)
    return {pos: tuple(stages) for pos, stages in final.items()}


def _last_loss(actions: tuple[Action, ...], layout: Layout) -> int | None:
    """The position of the last F of a last stage in `actions` (None: there is none)."""
    found = None
    for pos, action in enumerate(actions):
        if any(p.op is Op.F and layout.nxt[p.stage] < 0 for p in action.compute_parts()):
            found = pos
    return found


def forward_only(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    """One rank's list for evaluate(): its F actions (pairs give their F part) and F transfers."""
    keep = (Op.F, Op.RECV_F, Op.SEND_F)
    out: list[Action] = []
    for action in actions:
        if action.op is Op.OVERLAP_F_B:
            out.extend(p for p in action.parts if p.op is Op.F)
        elif action.op in keep:
            out.append(action)
    return tuple(out)
