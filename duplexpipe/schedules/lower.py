"""Lowering pass: insert SEND/RECV actions into a compute-only schedule."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from duplexpipe.schedules.ir import Action, Op, Schedule, ScheduleError


@dataclass(frozen=True)
class Layout:
    """Integer tables of one schedule's stage chains, and its tensor tokens.

    Token `s*M + m` is the forward input of stage s for microbatch m; token
    `S*M + s*M + m` the gradient of stage s's output (its backward input).
    """

    num_stages: int
    """S: how many stages."""
    num_microbatches: int
    """M: how many microbatches."""
    rank: tuple[int, ...]
    """rank[s]: the rank of stage s."""
    nxt: tuple[int, ...]
    """nxt[s]: the next stage in s's chain, or -1."""
    prv: tuple[int, ...]
    """prv[s]: the previous stage in s's chain, or -1."""
    lo: tuple[int, ...]
    """lo[s]: the first microbatch through stage s."""
    hi: tuple[int, ...]
    """hi[s]: one past the last microbatch through stage s."""

    @staticmethod
    def of(schedule: Schedule) -> Layout:
        """The layout of `schedule`'s stage table."""
        count, groups = schedule.num_stages, schedule.num_groups
        per_copy = schedule.num_microbatches // (count // groups)
        return Layout(
            count, schedule.num_microbatches, tuple(i.rank for i in schedule.stages),
            tuple(s + 1 if (s + 1) % groups else -1 for s in range(count)),
            tuple(s - 1 if s % groups else -1 for s in range(count)),
            tuple(s // groups * per_copy for s in range(count)),
            tuple((s // groups + 1) * per_copy for s in range(count)))

    @property
    def num_tokens(self) -> int:
        """How many tensor tokens exist (forward inputs and output gradients of every stage)."""
        return 2 * self.num_stages * self.num_microbatches

    def token_text(self, token: int, role: str) -> tuple[str, int]:
        """The action that `role` ("send", "recv" or "produce") does for `token`, and its rank."""
        half = self.num_stages * self.num_microbatches
        backward, rest = divmod(token, half)
        stage, mb = divmod(rest, self.num_microbatches)
        if role == "recv":
            return f"{stage}{'RECV_B' if backward else 'RECV_F'}{mb}", self.rank[stage]
        peer = self.nxt[stage] if backward else self.prv[stage]
        if role == "send":
            return f"{peer}{'SEND_B' if backward else 'SEND_F'}{mb}", self.rank[peer]
        return (f"{peer}B{mb} (or {peer}I{mb})" if backward else f"{peer}F{mb}"), self.rank[peer]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a pass allocates many acyclic objects.

    The passes build hundreds of thousands of tuples and Actions for large schedules; the
    collector's repeated scans of them cost more than the pass itself. The previous state
    is restored on exit, also on error.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def lower(schedule: Schedule) -> Schedule:
    """Return `schedule` with SEND/RECV actions inserted (one pass for every schedule).

    A schedule that already holds comm actions is returned unchanged (lowering is
    idempotent; `verify` checks such a schedule's comms as they are).

    Rules, following the execution contract in DESIGN.md:

    - a SEND follows right after the compute that produced its tensor: SEND_F after
      the F, SEND_B after the B or I (also when that is a part of an OVERLAP_F_B pair,
      whose sends follow the pair in part order);
    - no comm action between consecutive stages on one rank (local handoff);
    - for each ordered pair of ranks the receiver posts its RECVs in exactly the
      sender's posting order;
    - each RECV is posted right before the compute that precedes its consumer, so the
      transfer overlaps that compute; a RECV moves earlier still where the pair's
      order demands it (RECV k comes no later than RECV k+1 of the same pair).
      RECVs posted at one spot are ordered by sender rank, then by the sender's order.

    Raises ScheduleError for an unknown stage or microbatch, or when a tensor that must
    cross ranks has no consumer (run `verify` on the compute-only schedule for the full
    diagnosis).
    """
    if schedule.has_comms:
        return schedule
    with gc_paused():
        return _lower(schedule)


def _lower(schedule: Schedule) -> Schedule:
    layout = Layout.of(schedule)
    consumer = _consumer_positions(schedule, layout)
    lowered = []
    flats, pairs = _with_sends(schedule, layout, consumer)
    slots = _place_receives(pairs, schedule.num_ranks)
    for rank, (flat, starts) in enumerate(flats):
        if not slots[rank]:
            lowered.append(tuple(flat))
            continue
        out: list[Action] = []
        done = 0
        for pos in sorted(slots[rank]):
            out += flat[done:starts[pos]]
            out += slots[rank][pos]
            done = starts[pos]
        out += flat[done:]
        lowered.append(tuple(out))
    return Schedule(schedule.name, schedule.num_ranks, schedule.num_microbatches, schedule.stages,
                    tuple(lowered))


def _consumer_positions(schedule: Schedule, layout: Layout) -> list[int]:
    """Token -> position (in its rank's list) of the compute that consumes it, or -1."""
    nmb, count = layout.num_microbatches, layout.num_stages
    half = count * nmb
    found = [-1] * (2 * half)
    f_op, b_op, i_op, overlap = Op.F, Op.B, Op.I, Op.OVERLAP_F_B
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            for part in (action.parts if action.op is overlap else (action,)):
                stage, mb, op = part.stage, part.microbatch, part.op
                if stage >= count or not 0 <= mb < nmb:
                    raise ScheduleError(f"cannot lower {schedule.name!r}: {part} at rank {rank}, position "
                                        f"{pos} names an unknown stage or microbatch ({count} stages, {nmb} "
                                        "microbatches)")
                if op is f_op:
                    found[stage * nmb + mb] = pos
                elif op is b_op or op is i_op:
                    found[half + stage * nmb + mb] = pos
    return found


_Message = tuple[int, Op, int, int]
"""(receiving stage, RECV op, microbatch, consumer position in the receiver's list)."""
_Route = tuple[int, int, int, Op, Op]
"""(peer stage, peer rank, peer's token base, SEND op, RECV op) of a stage's output that crosses ranks."""


def _routes(layout: Layout) -> tuple[list[_Route | None], list[_Route | None]]:
    """Per stage: where its forward output and its input gradient go, None when it stays local."""
    nmb, half, rank = layout.num_microbatches, layout.num_stages * layout.num_microbatches, layout.rank
    fwd: list[_Route | None] = []
    bwd: list[_Route | None] = []
    for s in range(layout.num_stages):
        n, p = layout.nxt[s], layout.prv[s]
        crosses_next, crosses_prev = n >= 0 and rank[n] != rank[s], p >= 0 and rank[p] != rank[s]
        fwd.append((n, rank[n], n * nmb, Op.SEND_F, Op.RECV_F) if crosses_next else None)
        bwd.append((p, rank[p], half + p * nmb, Op.SEND_B, Op.RECV_B) if crosses_prev else None)
    return fwd, bwd


def _with_sends(schedule: Schedule, layout: Layout, consumer: list[int]
                ) -> tuple[list[tuple[list[Action], list[int]]], dict[tuple[int, int], list[_Message]]]:
    """Per rank: its list with SENDs inserted, and where each original action landed in it;
    per (sender, receiver): the messages in the sender's posting order."""
    fwd, bwd = _routes(layout)
    f_op, b_op, i_op, overlap = Op.F, Op.B, Op.I, Op.OVERLAP_F_B
    flats = []
    pairs: dict[tuple[int, int], list[_Message]] = {}
    for rank, row in enumerate(schedule.actions):
        flat: list[Action] = []
        starts: list[int] = []
        for action in row:
            starts.append(len(flat))
            flat.append(action)
            for part in (action.parts if action.op is overlap else (action,)):
                op = part.op
                if op is f_op:
                    route = fwd[part.stage]
                else:
                    route = bwd[part.stage] if op is b_op or op is i_op else None
                if route is None:
                    continue
                peer, peer_rank, base, send_op, recv_op = route
                mb = part.microbatch
                if consumer[base + mb] < 0:
                    needed = f"{peer}F{mb}" if op is f_op else f"{peer}B{mb} (or {peer}I{mb})"
                    raise ScheduleError(f"cannot lower {schedule.name!r}: {part} on rank {rank} produces a "
                                        f"tensor for stage {peer}, but rank {peer_rank} has no {needed}")
                flat.append(Action(part.stage, send_op, mb))
                queue = pairs.get((rank, peer_rank))
                if queue is None:
                    queue = pairs[(rank, peer_rank)] = []
                queue.append((peer, recv_op, mb, consumer[base + mb]))
        flats.append((flat, starts))
    return flats, pairs


def _place_receives(pairs: dict[tuple[int, int], list[_Message]],
                    num_ranks: int) -> list[dict[int, list[Action]]]:
    """Per receiving rank: position -> the RECVs posted right before the action there.

    A receive's slot is one compute ahead of its consumer; walking each pair's messages
    backwards, a receive never sits after the next receive of the same pair.
    """
    slots: list[dict[int, list[Action]]] = [{} for _ in range(num_ranks)]
    for sender, receiver in sorted(pairs):
        messages = pairs[(sender, receiver)]
        where = [0] * len(messages)
        latest = messages[-1][3]
        for seq in range(len(messages) - 1, -1, -1):
            slot = messages[seq][3] - 1
            if slot > latest:
                slot = latest
            latest = where[seq] = slot if slot > 0 else 0
        target = slots[receiver]
        for seq, (stage, op, mb, _) in enumerate(messages):
            here = target.get(where[seq])
            if here is None:
                here = target[where[seq]] = []
            here.append(Action(stage, op, mb))
    return slots
