"""One rank's plan, derived once from the lowered schedule: its lists, its stages' roles, where gradients are final."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

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
    sends_done: dict[PartKey, tuple[SendKey, ...]] = field(default_factory=dict)
    """A compute part of this rank (op, stage, microbatch) -> this rank's sends that have surely completed once it
    ran: it consumed a message its peer sent after consuming theirs. gloo marks a send complete only when waited
    for, so there the runtime waits for these at that point (at once: they are done), freeing their tensors before
    the step's end instead of at it."""

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
            losses_final=_last_loss(actions, layout), eval_losses_final=_last_loss(eval_actions, layout),
            sends_done=sends_done(schedule, layout, rank))

    def sends_done_at(self) -> dict[int, tuple[SendKey, ...]]:
        """`sends_done` by position in `actions` (after the action at that position ran)."""
        out: dict[int, tuple[SendKey, ...]] = {}
        for pos, action in enumerate(self.actions):
            keys = tuple(k for part in action.compute_parts() for k in self.sends_done.get(_key(part), ()))
            if keys:
                out[pos] = keys
        return out

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
PartKey = tuple[Op, int, int]
"""A compute part: (op, stage, microbatch)."""
SendKey = tuple[Op, int, int]
"""A send as the transport names it: (SEND_F or SEND_B, the sending stage, microbatch)."""


def _key(action: Action) -> PartKey:
    return (action.op, action.stage, action.microbatch)


def _peer(layout: Layout, send: Action) -> int:
    """The rank a SEND goes to."""
    return layout.rank[layout.nxt[send.stage] if send.op is Op.SEND_F else layout.prv[send.stage]]


def _consumer(layout: Layout, positions: dict[PartKey, int], send: Action) -> tuple[int, PartKey] | None:
    """Where the receiving rank (its compute parts' `positions`) takes the message of `send`, and the part that
    takes it: the F of the next stage, or the first B or I of the previous one (None: its list has neither)."""
    if send.op is Op.SEND_F:
        keys: tuple[PartKey, ...] = ((Op.F, layout.nxt[send.stage], send.microbatch),)
    else:
        keys = ((Op.B, layout.prv[send.stage], send.microbatch), (Op.I, layout.prv[send.stage], send.microbatch))
    return min(((positions[k], k) for k in keys if k in positions), default=None)


def sends_done(schedule: Schedule, layout: Layout, rank: int) -> dict[PartKey, tuple[SendKey, ...]]:
    """For `rank`'s list in the lowered `schedule`: its compute parts after which some of its sends have surely
    completed (RankPlan.sends_done). A send S to rank p is complete once this rank took a message T that p sent
    after the compute that consumed S (p could not have posted T before taking S)."""
    positions: list[dict[PartKey, int]] = []
    sends: list[list[tuple[int, Action]]] = []
    for actions in schedule.actions:
        positions.append({_key(part): pos for pos, action in enumerate(actions) for part in action.compute_parts()})
        sends.append([(pos, a) for pos, a in enumerate(actions) if a.op in (Op.SEND_F, Op.SEND_B)])
    done: dict[PartKey, list[SendKey]] = {}
    for _, send in sends[rank]:
        peer = _peer(layout, send)
        consumed = _consumer(layout, positions[peer], send)
        if consumed is None:
            continue
        back = next((a for pos, a in sends[peer] if pos > consumed[0] and _peer(layout, a) == rank), None)
        taken = None if back is None else _consumer(layout, positions[rank], back)
        if taken is not None:
            done.setdefault(taken[1], []).append(_key(send))
    return {part: tuple(keys) for part, keys in done.items()}


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
