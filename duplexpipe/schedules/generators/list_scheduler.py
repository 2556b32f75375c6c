"""Greedy list scheduling of F, I and W passes under per-rank activation limits (the `auto` search's engine)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

EPS = 1e-9
"""Tolerance when comparing times and memory sums."""


@dataclass(frozen=True)
class Problem:
    """One chain of stages placed on ranks, with per-stage costs and per-rank activation limits."""

    num_ranks: int
    """P."""
    num_microbatches: int
    """M: every microbatch passes every stage, in stage order."""
    stage_rank: tuple[int, ...]
    """stage_rank[s]: the rank that runs stage s; stage s feeds stage s+1."""
    f: tuple[float, ...]
    """f[s]: forward time of stage s."""
    i: tuple[float, ...]
    """i[s]: input-gradient (I) time of stage s."""
    w: tuple[float, ...]
    """w[s]: weight-gradient (W) time of stage s."""
    memory: tuple[float, ...]
    """memory[s]: what one microbatch's activation of stage s occupies, from its F's start to its W's end."""
    limit: tuple[float, ...]
    """limit[r]: the most activation memory rank r may hold at once (same unit as `memory`)."""
    comm: float
    """Time of one message between two ranks (hand-overs on one rank are free)."""

    @property
    def num_stages(self) -> int:
        """S: the chain's length."""
        return len(self.stage_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages on `rank`, in chain order."""
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def hop(self, a: int, b: int) -> float:
        """Message time between stages a and b: `comm` across ranks, 0 on one rank."""
        return self.comm if self.stage_rank[a] != self.stage_rank[b] else 0.0

    def reserve(self, stage: int) -> float:
        """Memory an F of `stage` must leave free: the largest activation of a later stage on its rank.

        Keeping that room lets a microbatch that is already in flight always pass the rank's
        later stages, so the chain cannot jam with activations that wait for each other.
        """
        rank = self.stage_rank[stage]
        return max((self.memory[s] for s in range(stage + 1, self.num_stages) if self.stage_rank[s] == rank),
                   default=0.0)


@dataclass(frozen=True)
class Policy:
    """The knobs of one greedy run; the search tries several and keeps the best result."""

    alpha: float = 1.0
    """Scales each stage's in-flight target: the forwards it runs ahead of its input-gradients, by
    default the number that covers its round trip (its F's start to its gradient's arrival)."""
    theta: float = 1.0
    """A W runs while the rank would otherwise wait when the wait is at least theta x W (0: always)."""
    eager: bool = True
    """Run forwards beyond the in-flight target when nothing else is ready (memory permitting)."""
    backward_late_first: bool = True
    """Among ready input-gradients, take the later stage's first (else the earlier stage's)."""


@dataclass(frozen=True)
class Result:
    """One greedy schedule: per rank, its (op, stage, microbatch) list, and its makespan."""

    rows: tuple[tuple[tuple[str, int, int], ...], ...]
    """rows[r]: rank r's compute list; op is "F", "I" or "W"."""
    makespan: float
    """When the last pass ends (messages taking `Problem.comm`)."""


def round_trips(problem: Problem) -> list[float]:
    """Per stage: the shortest time from its F's start to its output gradient's arrival (F for the last)."""
    count = problem.num_stages
    trip = [0.0] * count
    for s in range(count - 1, -1, -1):
        if s == count - 1:
            trip[s] = problem.f[s]
        else:
            hop = problem.hop(s, s + 1)
            trip[s] = problem.f[s] + hop + trip[s + 1] + problem.i[s + 1] + hop
    return trip


def list_schedule(problem: Problem, policy: Policy, give_up_after: float = math.inf) -> Result | None:
    """Run the greedy once; None if it jams (no rank can move although work is left) or if a pass
    would end after `give_up_after` (the caller already holds something at least that good).

    Ranks are advanced in time order. A free rank takes, in this order: a forward whose
    stage has fewer than its target in flight; a ready input-gradient (I); another
    forward (if `policy.eager`); a W if the rank would otherwise wait at least theta x W,
    or nothing else can ever become ready; else it waits for its next input. Forwards
    need their input and the activation memory (`Problem.reserve` included); stages take
    microbatches in order; Ws run oldest first.
    """
    state = _Greedy(problem, policy)
    return state.run(give_up_after)


class _Greedy:
    """The state of one greedy run."""

    def __init__(self, problem: Problem, policy: Policy) -> None:
        p, m, count = problem.num_ranks, problem.num_microbatches, problem.num_stages
        self.pb, self.policy = problem, policy
        self.stages = [problem.stages_of(r) for r in range(p)]
        self.f_order = [list(reversed(st)) for st in self.stages]
        self.i_order = [list(reversed(st)) if policy.backward_late_first else st for st in self.stages]
        trip = round_trips(problem)
        cycle = [sum(problem.f[s] + problem.i[s] + problem.w[s] for s in st) or 1.0 for st in self.stages]
        self.target = [max(1, math.ceil(policy.alpha * trip[s] / cycle[problem.stage_rank[s]] - EPS))
                       for s in range(count)]
        self.need = [problem.memory[s] + problem.reserve(s) for s in range(count)]
        self.hop_next = [problem.hop(s, s + 1) if s + 1 < count else 0.0 for s in range(count)]
        self.count = count
        self.nf, self.ni = [0] * count, [0] * count
        self.f_at: list[list[float | None]] = [[None] * m for _ in range(count)]
        self.g_at: list[list[float | None]] = [[None] * m for _ in range(count)]
        self.f_at[0] = [0.0] * m
        self.queue: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.live, self.clock = [0.0] * p, [0.0] * p
        self.rows: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
        self.left = [3 * m * len(st) for st in self.stages]
        self.heap = [(0.0, r) for r in range(p)]

    def run(self, give_up_after: float) -> Result | None:
        heap, clock, left, limit = self.heap, self.clock, self.left, give_up_after + EPS
        while heap:
            tau, rank = heapq.heappop(heap)
            if not left[rank] or tau < clock[rank] - EPS:
                continue
            now = max(tau, clock[rank])
            choice = self._choose(rank, now)
            if choice is None:
                continue
            end = self._apply(rank, now, *choice)
            if end > limit:
                return None
            left[rank] -= 1
            clock[rank] = end
            heapq.heappush(heap, (end, rank))
        if any(left):
            return None
        return Result(tuple(tuple(row) for row in self.rows), max(clock))

    def _forward_ok(self, rank: int, s: int, now: float) -> bool:
        if self.nf[s] >= self.pb.num_microbatches:
            return False
        at = self.f_at[s][self.nf[s]]
        return at is not None and at <= now + EPS and self.live[rank] + self.need[s] <= self.pb.limit[rank] + EPS

    def _choose(self, rank: int, now: float) -> tuple[str, int] | None:
        """The pass `rank` runs at `now`, or None (it waits; a later event wakes it)."""
        nf, ni, g_at = self.nf, self.ni, self.g_at
        first_f = None
        for s in self.f_order[rank]:
            if self._forward_ok(rank, s, now):
                if nf[s] - ni[s] < self.target[s]:
                    return "F", s
                first_f = s if first_f is None else first_f
        for s in self.i_order[rank]:
            if ni[s] < nf[s]:
                at = g_at[s][ni[s]]
                if at is not None and at <= now + EPS:
                    return "I", s
        if first_f is not None and self.policy.eager:
            return "F", first_f
        queue = self.queue[rank]
        known, bound = self._next_events(rank, now)
        if queue and (min(known, bound) - now >= self.policy.theta * self.pb.w[queue[0][0]] - EPS
                      or min(known, bound) == math.inf):
            return "W", queue[0][0]
        if known < math.inf:
            heapq.heappush(self.heap, (known, rank))
        return None

    def _next_events(self, rank: int, now: float) -> tuple[float, float]:
        """(earliest known future input that would let `rank` run an F or I, a lower bound on unknown ones)."""
        pb, known, bound = self.pb, math.inf, math.inf
        for s in self.stages[rank]:
            if self.ni[s] < self.nf[s]:
                at = self.g_at[s][self.ni[s]]
                if at is None:
                    bound = min(bound, now + pb.i[s + 1] + self.hop_next[s])
                elif at > now:
                    known = min(known, at)
            nf = self.nf[s]
            if (nf < pb.num_microbatches and self.live[rank] + self.need[s] <= pb.limit[rank] + EPS
                    and (self.policy.eager or nf - self.ni[s] < self.target[s])):
                at = self.f_at[s][nf]
                if at is None:
                    bound = min(bound, now + pb.f[s - 1] + self.hop_next[s - 1])
                elif at > now:
                    known = min(known, at)
        return known, bound

    def _apply(self, rank: int, now: float, op: str, s: int) -> float:
        """Record pass `op` of stage `s` starting at `now`; deliver its output; return its end."""
        pb = self.pb
        if op == "W":
            stage, mb = self.queue[rank].popleft()
            self.live[rank] -= pb.memory[stage]
            self.rows[rank].append(("W", stage, mb))
            return now + pb.w[stage]
        if op == "F":
            mb = self.nf[s]
            self.nf[s] += 1
            self.live[rank] += pb.memory[s]
            end = now + pb.f[s]
            if s + 1 < self.count:
                self._deliver(self.f_at, s + 1, mb, end + self.hop_next[s])
            else:
                self.g_at[s][mb] = end
        else:
            mb = self.ni[s]
            self.ni[s] += 1
            self.queue[rank].append((s, mb))
            end = now + pb.i[s]
            if s > 0:
                self._deliver(self.g_at, s - 1, mb, end + self.hop_next[s - 1])
        self.rows[rank].append((op, s, mb))
        return end

    def _deliver(self, table: list[list[float | None]], stage: int, mb: int, at: float) -> None:
        table[stage][mb] = at
        rank = self.pb.stage_rank[stage]
        heapq.heappush(self.heap, (max(at, self.clock[rank]), rank))
