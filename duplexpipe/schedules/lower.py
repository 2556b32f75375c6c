"""Lowering pass: insert SEND/RECV actions into a compute-only schedule."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.execute import run_program
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.layout import Layout, gc_paused
from duplexpipe.schedules.program import COMPUTE

__all__ = ["lower"]


def lower(schedule: Schedule) -> Schedule:
    """Return `schedule` with SEND/RECV actions inserted (one pass for every schedule).

    A schedule that already holds comm actions is returned unchanged (lowering is
    idempotent; `verify` checks such a schedule's comms as they are). UNSHARD, RESHARD and
    REDUCE_GRAD actions (`schedules.shard`) stay where they are and take no time in the run
    that orders the messages.

    Rules, following the execution contract in docs/design.md:

    - a SEND follows right after the compute that produced its tensor: SEND_F after
      the F, SEND_B after the B or I (also when that is a part of an OVERLAP_F_B pair,
      whose sends follow the pair in part order);
    - no comm action between consecutive stages on one rank (local handoff);
    - pair order (what NCCL needs: it runs every point-to-point op between two ranks, both
      directions, on one stream in posting order): the messages between two ranks are
      ordered by when their producer ends in a run of the compute-only schedule with F=1,
      B=2, I=W=1 and each message taking 2**-10 (nearly free: it breaks ties toward
      messages that crossed fewer links; remaining ties go to the lower rank, and each
      rank's own messages keep their list order). Both ranks post their SENDs to and RECVs
      from each other in exactly that order, so each receiver also follows its sender;
    - each RECV is posted right before the compute that precedes its consumer, so the
      transfer overlaps that compute, unless the pair order moves it: never before the
      rank's own SENDs to the same peer that come earlier in the pair order (then it sits
      right after them), never after its SENDs that come later (then it moves up to just
      before their producer). RECVs posted at one spot are ordered by peer rank, then by
      the pair order.

    In that run every message is produced before its consumer starts, so each RECV's
    window is never empty and the lowering keeps the compute-only schedule's dependencies:
    deadlock-free whenever the input is, on NCCL too (both ranks post every message of the
    pair order before they post the next). A deadlocked input is still lowered, each
    receiver following its sender, but may miss the pair order (`verify` names the deadlock).

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
    slots = _place_receives(pairs, _production_times(schedule, layout), schedule.num_ranks)
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
            if action.op.is_fsdp:
                continue
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


_COSTS = (1.0, 2.0, 1.0, 1.0)
"""Compute times F, B, I, W of the run that orders each pair's messages (docs/design.md's reference costs)."""
_TIE_BREAK = 2.0 ** -10
"""The message time of that run: small against a compute, so it mostly breaks ties (toward messages
that crossed fewer links); exact in binary, so equal paths still tie. Any message time would keep
the lowering sound; a run with free messages ties often and then leaves RECVs later than needed."""


def _production_times(schedule: Schedule, layout: Layout) -> list[list[float]]:
    """Per rank, per position: when that compute ends when the compute-only schedule runs with
    `_COSTS`, every receive posted up front and each message taking `_TIE_BREAK` (inf from
    where a rank gets stuck, if it does)."""
    nmb, nxt, prv, rank = layout.num_microbatches, layout.nxt, layout.prv, layout.rank
    half, stages = layout.num_stages * nmb, range(layout.num_stages)

    def code(peer: int, stage: int, base: int) -> int:
        """-1: no input; >= 0: a local token's base; else -2-base, a message (input -1-token)."""
        return -1 if peer < 0 else base if rank[peer] == rank[stage] else -2 - base
    f_in = [code(prv[s], s, s * nmb) for s in stages]
    b_in = [code(nxt[s], s, half + s * nmb) for s in stages]
    f_out = [nxt[s] * nmb if nxt[s] >= 0 else -1 for s in stages]
    b_out = [half + prv[s] * nmb if prv[s] >= 0 else -1 for s in stages]
    f_op, b_op, i_op, overlap = Op.F, Op.B, Op.I, Op.OVERLAP_F_B
    (f_cost, b_cost, i_cost, w_cost), none = _COSTS, ()
    program = []
    for row in schedule.actions:
        compiled: list[tuple] = []
        add = compiled.append
        for action in row:
            op, stage, mb = action.op, action.stage, action.microbatch
            if op is f_op or op is b_op or op is i_op:
                i, o = (f_in[stage], f_out[stage]) if op is f_op else (b_in[stage], b_out[stage])
                add((COMPUTE, None, (i + mb,) if i >= 0 else none if i == -1 else (i + 1 - mb,),
                     (o + mb,) if o >= 0 else none, f_cost if op is f_op else b_cost if op is b_op else i_cost))
            elif op is overlap:  # F&B: an F part, then a B or I part
                fwd, back = action.parts
                fm, bm = fwd.microbatch, back.microbatch
                i, o, i2, o2 = f_in[fwd.stage], f_out[fwd.stage], b_in[back.stage], b_out[back.stage]
                ins = (((i + fm,) if i >= 0 else none if i == -1 else (i + 1 - fm,))
                       + ((i2 + bm,) if i2 >= 0 else none if i2 == -1 else (i2 + 1 - bm,)))
                outs = ((o + fm,) if o >= 0 else none) + ((o2 + bm,) if o2 >= 0 else none)
                add((COMPUTE, None, ins, outs, f_cost + (b_cost if back.op is b_op else i_cost)))
            else:  # W, or an UNSHARD, RESHARD or REDUCE_GRAD (no time here)
                add((COMPUTE, None, none, none, 0.0 if action.op.is_fsdp else w_cost))
        program.append(compiled)
    run = run_program(program, layout.num_tokens, comm=_TIE_BREAK, record=True, all_posted=True)
    inf = float("inf")
    return [[end for _, _, end in events] + [inf] * (len(row) - len(events))
            for events, row in zip(run.events, schedule.actions, strict=True)]


_Message = tuple[int, int, int, Op, int]
"""(producer position in the sender's list, consumer position in the receiver's list, and the
receiving stage, RECV op and microbatch of its RECV)."""
_Route = tuple[int, int, int, Op, Op]
"""(peer stage, peer rank, peer's token base, SEND op, RECV op) of a stage's output that crosses ranks."""


def _routes(layout: Layout) -> tuple[list[_Route | None], list[_Route | None]]:
    """Per stage: where its forward output and its input gradient go, None when it stays local."""
    nmb, half = layout.num_microbatches, layout.num_stages * layout.num_microbatches
    fwd: list[_Route | None] = []
    bwd: list[_Route | None] = []
    for s in range(layout.num_stages):
        n, p = layout.nxt[s], layout.prv[s]
        to_next, to_prev = layout.peer(s, backward=False), layout.peer(s, backward=True)
        fwd.append((n, to_next, n * nmb, Op.SEND_F, Op.RECV_F) if to_next >= 0 else None)
        bwd.append((p, to_prev, half + p * nmb, Op.SEND_B, Op.RECV_B) if to_prev >= 0 else None)
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
        for pos, action in enumerate(row):
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
                queue.append((pos, consumer[base + mb], peer, recv_op, mb))
        flats.append((flat, starts))
    return flats, pairs


def _place_receives(pairs: dict[tuple[int, int], list[_Message]], ends: list[list[float]],
                    num_ranks: int) -> list[dict[int, list[Action]]]:
    """Per receiving rank: position -> the RECVs posted right before the action there (in order).

    The pair order of two ranks a < b merges a's messages to b and b's to a, each kept in
    its sender's order, by production time, a's first at equal times (so the messages of
    one compute stay together). A message's place in it is found by bisecting the other
    side's (sorted) production times.
    """
    slots: list[dict[int, list[Action]]] = [{} for _ in range(num_ranks)]
    for a, b in sorted({(min(k), max(k)) for k in pairs}):
        down, up = pairs.get((a, b), []), pairs.get((b, a), [])
        down_made, up_made = [m[0] for m in down], [m[0] for m in up]
        down_at, up_at = [ends[a][p] for p in down_made], [ends[b][p] for p in up_made]
        _settle(down, [bisect_left(up_at, t) for t in down_at], up_made, slots[b])
        _settle(up, [bisect_right(down_at, t) for t in up_at], down_made, slots[a])
    return slots


def _settle(messages: list[_Message], sends_before: list[int], own: list[int],
            target: dict[int, list[Action]]) -> None:
    """Place the RECVs of one direction of a pair on their receiver.

    `sends_before[k]`: how many of the receiver's own SENDs to the peer (produced at
    positions `own`) precede message k in the pair order. RECV k goes one compute ahead of
    its consumer, but after those SENDs (at or past the slot after the last one's
    producer), before the next one (at or before its producer's slot), before its consumer
    and never after RECV k+1.
    """
    big = 1 << 62
    bounds = [-1, *own, big]
    where = []
    latest = big
    for (_, consumer, _, _, _), k in zip(reversed(messages), reversed(sends_before), strict=True):
        last, first = bounds[k + 1], bounds[k] + 1
        if consumer < last:
            last = consumer
        if latest < last:
            last = latest
        slot = consumer - 1 if consumer > first else first
        latest = slot if slot < last else last
        where.append(latest)
    where.reverse()
    at, here = -1, []
    for slot, (_, _, stage, op, mb) in zip(where, messages, strict=True):
        if slot != at:
            at, here = slot, target.setdefault(slot, [])
        here.append(Action(stage, op, mb))
