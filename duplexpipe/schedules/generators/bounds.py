"""Lower bounds on the makespan of any schedule of a `Problem` (a chain of stages placed on ranks under memory limits).

The bound of rank r (`rank_bound`) adds up what every schedule must spend on r:

- head: until the first gradient can reach r (`first_i`), r can only run forwards, and
  each of them holds its activation until its W ends, so r runs at most what its memory
  holds (`_fill`); the rest of that window it idles. Likewise, until the first input of its
  chain-last stage can arrive, r runs only the forwards of its earlier stages;
- tail: after the start t of r's last forward (a forward of r's chain-last stage), r can only
  run the I and W of the activations it holds at t (its memory again), while that
  microbatch still has to cross the rest of the chain and come back to stage 0's W
  (`chain`): r idles at least chain - that work after t. The head's idle time lies before t
  (unless all of r's activations fit at once), so the makespan is at least r's work plus both.

With one stage per rank this is the two-sided bound of docs/benchmarks.md (117 for zb-h1's
case); with the V placement of ZB-V it is 116.5 at P=8, M=32, latency 0.5, limit P: zbv's
makespan there. Activations are held from their F's start to their W's end, as
`Timeline.peak_activations` counts; messages take `Problem.comm` and nothing delays them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duplexpipe.schedules.generators.list_scheduler import EPS, Problem


@dataclass(frozen=True)
class RankBound:
    """The terms of one rank's bound."""

    rank: int
    """Which rank."""
    start: float
    """The earliest time its first forward can start."""
    first_i: float
    """The earliest time its first input-gradient can start."""
    head_idle: float
    """Time it must idle before its last forward starts."""
    after: float
    """The most work it can do from its last forward's start on."""
    chain: float
    """The shortest time from its last forward's start to the end of that microbatch's stage-0 W."""
    value: float
    """The bound: work + head_idle + the tail's idle time, max(0, chain - after)."""


def earliest_starts(problem: Problem) -> tuple[list[float], list[float]]:
    """(F, I) per stage: the earliest start of microbatch 0's forward and input-gradient, nothing waiting."""
    count = problem.num_stages
    ef = [0.0] * count
    for s in range(1, count):
        ef[s] = ef[s - 1] + problem.f[s - 1] + problem.hop(s - 1, s)
    ei = [0.0] * count
    ei[-1] = ef[-1] + problem.f[-1]
    for s in range(count - 2, -1, -1):
        ei[s] = ei[s + 1] + problem.i[s + 1] + problem.hop(s, s + 1)
    return ef, ei


def _fill(problem: Problem, stages: list[int], value: list[float], room: float) -> float:
    """The most total `value` of activations (at most M per stage) that fit in `room` (a fractional knapsack)."""
    m, total = problem.num_microbatches, 0.0
    ranked = sorted(stages, key=lambda s: -math.inf if problem.memory[s] <= 0 else -value[s] / problem.memory[s])
    for s in ranked:
        size = problem.memory[s]
        count = float(m) if size <= 0 else min(float(m), max(0.0, room) / size)
        total += count * value[s]
        room -= count * size
    return total


def rank_bound(problem: Problem, rank: int, ef: list[float], ei: list[float]) -> RankBound:
    """The bound that `rank`'s work, memory and position on the chain impose (see the module docstring)."""
    pb, m, stages = problem, problem.num_microbatches, problem.stages_of(rank)
    work = m * sum(pb.f[s] + pb.i[s] + pb.w[s] for s in stages)
    start, first_i = min(ef[s] for s in stages), min(ei[s] for s in stages)
    last = stages[-1]
    limit = pb.limit[rank]
    # Until its chain-last stage's first input can arrive, the rank runs only its earlier stages'
    # forwards; until its first gradient can arrive, only forwards, a limit's worth (all of them
    # live at once). The first window always ends before t; the second does unless every
    # activation fits at once (then the last forward may come before any gradient).
    earlier = stages[:-1]
    busy_early = min(ef[last] - start, m * sum(pb.f[s] for s in earlier), _fill(pb, earlier, list(pb.f), limit))
    head_idle = max(start, ef[last] - busy_early)
    if m * sum(pb.memory[s] for s in stages) > limit + EPS:
        head_idle = max(head_idle, first_i - min(first_i - start, _fill(pb, stages, list(pb.f), limit)))
    backward = [pb.i[s] + pb.w[s] for s in range(pb.num_stages)]
    after = pb.f[last] + backward[last] + _fill(pb, stages, backward, limit - pb.memory[last])
    after = min(after, work)
    chain = ei[0] + pb.i[0] + pb.w[0] - ef[last]
    value = work + head_idle + max(0.0, chain - after)
    return RankBound(rank, start, first_i, head_idle, after, chain, value)


def makespan_bound(problem: Problem) -> float:
    """A lower bound on the makespan of every schedule of `problem` (the largest rank bound)."""
    ef, ei = earliest_starts(problem)
    return max(rank_bound(problem, r, ef, ei).value for r in range(problem.num_ranks))
