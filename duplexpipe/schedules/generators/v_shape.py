"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): V-shape building blocks.

Both place 2P stages in a V like ZB-V (rank r runs the down stage r and the up stage 2P-1-r) and
repeat one building block per microbatch: on every rank, the forward of each of its two stages,
the input-gradient (I) of each, and the two weight-gradients (W), six unit passes in a period of
six slots. The block fixes the slot of each F and I relative to the microbatch's start; Ws fill the
two free slots, oldest first. An activation lives from its F to its W, so the block's lifespan
decides the peak (Little's law: live activations = lifespan / period):

- V-Min: every hop of the V in the next slot (the shortest lifespan a V can have), a two-slot gap
  at the fold where P is a multiple of 3 (else two passes of a rank would share a slot). Peak
  (P+4)//3 1F1B-stage activations per rank: about 1/3 of 1F1B's P.
- V-Half: the down forwards and the up input-gradients two slots apart, a three-slot gap at the
  back turn where P is even. Peak (P+2)//2: about 1/2 of 1F1B's P, with a smaller bubble.

How far below the paper's constants a period-6 V block can go: a microbatch's down-stage activation on rank 0 lives
at least 4P+1 slots (every hop of the V, then its W) and its up-stage one 3, so a rank holds on average at least
(4P+4)/6 V-stage activations; a rank reaches that only when each W runs right after its I, which the slots allow only
where 2r is a multiple of 6 (else two passes meet on one residue), and the other ranks, W placed however, hold more
(at P=8: 8 V-stage activations on ranks 1, 2, 4, 5, 7 against 6 on 0, 3, 6 for every W placement, and no gap at
the fold or the turn, nor a wider spacing of the passes, does better there: V-Min's 4/8 of 1F1B; 1/3 only as P
grows).

A rank runs its passes in slot order; the executor and the simulator start each as soon as its
inputs are there, which squeezes the idle slots of the warm-up and cool-down out.
"""

from __future__ import annotations

from duplexpipe.schedules.generators._common import require_counts, v_stages
from duplexpipe.schedules.ir import Action, Op, Schedule

V_HALF = "v-half"
V_MIN = "v-min"
PERIOD = 6
"""Slots of one building block on one rank: two F, two I, two W."""


def check_v_half(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 2 and num_microbatches >= 1 (both integers)."""
    require_counts(V_HALF, num_ranks, num_microbatches, min_ranks=2)


def check_v_min(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 2 and num_microbatches >= 1 (both integers)."""
    require_counts(V_MIN, num_ranks, num_microbatches, min_ranks=2)


def block_slots(name: str, num_ranks: int, rank: int) -> tuple[int, int, int, int]:
    """Slots of microbatch 0 on `rank`: (F of the down stage, F of the up stage, I of the up stage,
    I of the down stage); microbatch m takes each slot + PERIOD * m."""
    p, r = num_ranks, rank
    if name == V_MIN:
        gap = 2 if p % 3 == 0 else 0
        return r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r
    if name == V_HALF:
        gap = 3 if p % 2 == 0 else 0
        return 2 * r, 3 * p - 2 - r, 3 * p + gap + 2 * r - 1, 6 * p + gap - 2 - r
    raise ValueError(f"no V-shape building block named {name!r}; known: {V_HALF}, {V_MIN}")


def v_shape_row(name: str, rank: int, num_ranks: int, num_microbatches: int) -> tuple[Action, ...]:
    """Rank `rank`'s passes in slot order, each W in the first free slot after its I (oldest W first)."""
    down, up = rank, 2 * num_ranks - 1 - rank
    passes = ((down, Op.F), (up, Op.F), (up, Op.I), (down, Op.I))
    slotted: dict[int, Action] = {}
    for first, (stage, op) in zip(block_slots(name, num_ranks, rank), passes, strict=True):
        for m in range(num_microbatches):
            slot = first + PERIOD * m
            if slot in slotted:
                raise AssertionError(f"{name}: {slotted[slot]} and {stage}{op.value}{m} share slot {slot} "
                                     f"on rank {rank}")
            slotted[slot] = Action(stage, op, m)
    row: list[Action] = []
    waiting: list[Action] = []
    last = max(slotted)
    slot = 0
    while slot <= last or waiting:
        action = slotted.get(slot)
        if action is not None:
            row.append(action)
            if action.op is Op.I:
                waiting.append(Action(action.stage, Op.W, action.microbatch))
        elif waiting:
            row.append(waiting.pop(0))
        slot += 1
    return tuple(row)


def _v_shape(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    rows = tuple(v_shape_row(name, r, num_ranks, num_microbatches) for r in range(num_ranks))
    return Schedule(name, num_ranks, num_microbatches, v_stages(num_ranks), rows)


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activation memory ((P+2)//2 per rank at M >= 2P), bubble about P/(2M)."""
    check_v_half(num_ranks, num_microbatches)
    return _v_shape(V_HALF, num_ranks, num_microbatches)


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory ((P+4)//3 per rank at M >= 2P), bubble about 2P/(3M)."""
    check_v_min(num_ranks, num_microbatches)
    return _v_shape(V_MIN, num_ranks, num_microbatches)
