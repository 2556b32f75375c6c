"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): V-shape building blocks.

Both place 2P stages in a V like ZB-V (rank r runs the down stage r and the up stage 2P-1-r) and
repeat one building block per microbatch. A block is the slot of each F and I of microbatch 0 along
the V (down forwards, up forwards, up input-gradients, down input-gradients); microbatch m takes
each slot + period x m, and each rank's two Ws fill its free slots, oldest first. An activation
lives from its F to its W, so the block's lifespan over its period decides a rank's peak (Little's
law).

The paper gives closed-form blocks of period 6 holding (P+2)//2 (V-Half) and (P+4)//3 (V-Min)
1F1B-stage activations per rank: half and a third of 1F1B's P only as P grows (at P=8: 5/8 and
4/8). Here each name is the bound it promises, on every rank and at every P: V-Half holds at most
half of 1F1B's activation peak (P V-stage activations, each half a 1F1B stage), V-Min at most a
third (ceil(2P/3) of them). `v_block` searches the fastest block that keeps the bound: the shortest
period, then the shortest V, over blocks whose four legs advance one or two slots per hop with a
gap at each of the three turns.

What the bounds cost: with period 6 a microbatch's activations on a rank live at least 4P+4 slots
in all (the down stage's from its F, over every hop of the V, to its W; the up stage's three), so
a rank holds at least (4P+4)/6 V-stage activations on average. That is under P from P=3, and from
P=6 (and at P=4) the paper's period-6 V-Min block keeps V-Half's bound at no cost in throughput (at
P=8: 8 of 16; P=3 and P=5 take period 9 and 8). It is over 2P/3 at every P: V-Min needs a longer
period (8 at P=8, where no period-7 block of the kind holds 6), so its steady state runs at 6/8 of
a bubble-free rate; it is the schedule for when memory decides.

A rank runs its passes in slot order; the executor and the simulator start each as soon as its
inputs are there, which squeezes the idle slots of the warm-up and cool-down out.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from duplexpipe.schedules.generators._common import require_counts, v_stages
from duplexpipe.schedules.ir import Action, Op, Schedule

V_HALF = "v-half"
V_MIN = "v-min"
MIN_PERIOD = 6
"""A block's shortest period: a rank's two F, two I and two W each take a slot."""
MAX_GAP = 6
"""The widest gap at a turn of the V the search tries (the fastest blocks found use at most 2)."""
PASSES = ((Op.F, "down"), (Op.F, "up"), (Op.I, "up"), (Op.I, "down"))
"""A rank's four slotted passes, in the order of `VBlock.slots`' rows."""


@dataclass(frozen=True)
class VBlock:
    """One V building block: its period and, per rank, the slots of microbatch 0's four passes."""

    period: int
    """Slots between one microbatch's block and the next's."""
    slots: tuple[tuple[int, int, int, int], ...]
    """slots[r]: (F of the down stage, F of the up stage, I of the up stage, I of the down stage)."""
    peak: int
    """The most V-stage activations any rank holds in the steady state."""


def check_v_half(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 2 and num_microbatches >= 1 (both integers)."""
    require_counts(V_HALF, num_ranks, num_microbatches, min_ranks=2)


def check_v_min(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 2 and num_microbatches >= 1 (both integers)."""
    require_counts(V_MIN, num_ranks, num_microbatches, min_ranks=2)


def activation_bound(name: str, num_ranks: int) -> int:
    """The most V-stage activations `name` lets a rank hold: half / a third of 1F1B's 2P, rounded up."""
    if name == V_HALF:
        return num_ranks
    if name == V_MIN:
        return math.ceil(2 * num_ranks / 3)
    raise ValueError(f"no V-shape building block named {name!r}; known: {V_HALF}, {V_MIN}")


def v_block(num_ranks: int, bound: int) -> VBlock:
    """The fastest block on `num_ranks` ranks whose every rank holds at most `bound` V-stage activations.

    Tries periods from 6 up, and within a period the blocks by the length of their V; the first
    that keeps the bound wins. Raises ValueError if bound < 2 (a rank holds both of its stages'
    activations for a microbatch). A period over the V's length always succeeds (one microbatch
    in flight), so the search ends.
    """
    if num_ranks < 2 or bound < 2:
        raise ValueError(f"a V block needs num_ranks >= 2 and an activation bound >= 2, got num_ranks={num_ranks}, "
                         f"bound={bound}")
    period = MIN_PERIOD
    while True:
        for _, spacing, gaps in _shapes(num_ranks, period):
            slots = _slots(num_ranks, spacing, gaps)
            if all(len({t % period for t in row}) == 4 for row in slots):
                peak = _steady_peak(slots, period, bound)
                if peak <= bound:
                    return VBlock(period, slots, peak)
        period += 1


def _shapes(num_ranks: int, period: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Every (length of the V, slots per hop on each leg, gap at each turn), shortest V first."""
    shapes = []
    for spacing in itertools.product((1, 2), repeat=4):
        for gaps in itertools.product(range(min(period, MAX_GAP + 1)), repeat=3):
            shapes.append((sum(spacing) * (num_ranks - 1) + sum(gaps), spacing, gaps))
    shapes.sort()
    return shapes


def _slots(num_ranks: int, spacing: tuple[int, ...], gaps: tuple[int, ...]) -> tuple[tuple[int, int, int, int], ...]:
    """Per rank, the slots of its four passes when each leg of the V advances `spacing` slots per hop."""
    p, t = num_ranks, 0
    slots = [[0] * 4 for _ in range(p)]
    legs = (range(p), range(p - 1, -1, -1), range(p), range(p - 1, -1, -1))
    for leg, ranks in enumerate(legs):
        for hop, rank in enumerate(ranks):
            if hop:
                t += spacing[leg]
            elif leg:
                t += 1 + gaps[leg - 1]
            slots[rank][leg] = t
    return tuple((a, b, c, d) for a, b, c, d in slots)


def _walk(firsts: tuple[int, ...], period: int, count: int) -> Iterator[tuple[Op, int, int]]:
    """A rank's passes in slot order as (op, index into PASSES, microbatch): microbatch m's pass takes its first slot
    + period x m; each W (index: its I's) takes the first free slot after its I, oldest W first."""
    slotted = {first + period * m: (index, m) for index, first in enumerate(firsts) for m in range(count)}
    waiting: deque[tuple[int, int]] = deque()
    last = max(slotted)
    slot = 0
    while slot <= last or waiting:
        found = slotted.get(slot)
        if found is not None:
            op = PASSES[found[0]][0]
            yield op, *found
            if op is Op.I:
                waiting.append(found)
        elif waiting:
            yield Op.W, *waiting.popleft()
        slot += 1


def _steady_peak(slots: tuple[tuple[int, int, int, int], ...], period: int, bound: int) -> int:
    """The most activations a rank holds once the block repeats (stops early once over `bound`)."""
    repeats = max(max(row) for row in slots) // period + 4
    worst = 0
    for row in slots:
        live = 0
        for op, _, _ in _walk(row, period, repeats):
            live += 1 if op is Op.F else -1 if op is Op.W else 0
            worst = max(worst, live)
        if worst > bound:
            break
    return worst


def v_shape_row(block: VBlock, rank: int, num_ranks: int, num_microbatches: int) -> tuple[Action, ...]:
    """Rank `rank`'s passes in slot order, each W in the first free slot after its I (oldest W first)."""
    stage = {"down": rank, "up": 2 * num_ranks - 1 - rank}
    return tuple(Action(stage[PASSES[index][1]], op, m)
                 for op, index, m in _walk(block.slots[rank], block.period, num_microbatches))


def v_shape(name: str, num_ranks: int, num_microbatches: int, bound: int) -> Schedule:
    """The schedule of `v_block(num_ranks, bound)` over `num_microbatches`, named `name`."""
    block = v_block(num_ranks, bound)
    rows = tuple(v_shape_row(block, r, num_ranks, num_microbatches) for r in range(num_ranks))
    return Schedule(name, num_ranks, num_microbatches, v_stages(num_ranks), rows)


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: at most half of 1F1B's activation peak on every rank (P V-stage activations)."""
    check_v_half(num_ranks, num_microbatches)
    return v_shape(V_HALF, num_ranks, num_microbatches, activation_bound(V_HALF, num_ranks))


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: at most a third of 1F1B's activation peak on every rank (ceil(2P/3) V-stage activations)."""
    check_v_min(num_ranks, num_microbatches)
    return v_shape(V_MIN, num_ranks, num_microbatches, activation_bound(V_MIN, num_ranks))
