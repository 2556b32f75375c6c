"""`auto`: search a zero-bubble schedule for given per-stage F/I/W costs under a per-rank activation limit.

In the spirit of the automatic scheduler of Qi et al. ("Zero Bubble Pipeline Parallelism",
ICLR 2024): a greedy list scheduler (`list_scheduler`) places forwards, input-gradients
and weight-gradients rank by rank in time order, running W passes in what would be bubbles
and when memory runs out. It runs under a small grid of policies; the hand-made schedules
of the same stage placement (1F1B, ZB-H1, ZB-H2 for one stage per rank; ZB-V, DualPipeV,
V-Half, V-Min and the fastest V building block under the limit for the V) join as candidates when
they fit the limit. The best few are timed by `simulate` (the
project's exact simulator) and the shortest wins, so `auto` is never worse than those
hand-made schedules under the same limit. When a hand-made seed already reaches the lower
bound of `bounds.makespan_bound` (no schedule can be shorter), the greedy is not run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from duplexpipe.schedules.generators._common import linear_stages, require_counts, v_stages
from duplexpipe.schedules.generators.bounds import makespan_bound
from duplexpipe.schedules.generators.list_scheduler import Policy, Problem, list_schedule
from duplexpipe.schedules.ir import Action, Op, Schedule, StageInfo

if TYPE_CHECKING:
    from duplexpipe.schedules.simulate import CostModel

AUTO = "auto"
PLACEMENTS = ("linear", "v")
"""linear: stage s on rank s (P stages, like 1F1B); v: 2P stages folded in a V (like ZB-V)."""
KEEP = 3
"""How many of the greedy's best results the simulator re-times."""


@dataclass(frozen=True)
class Candidate:
    """One schedule the search considered."""

    label: str
    """"greedy(alpha=..., theta=..., ...)" or "seed zb-h1" etc."""
    makespan: float
    """Its simulated makespan under the search's cost model."""
    peak: float
    """Its largest per-rank activation peak, in the limit's unit."""


@dataclass(frozen=True)
class SearchResult:
    """What `search` found and how."""

    schedule: Schedule
    """The winner, named "auto"."""
    winner: Candidate
    """Which candidate it is."""
    candidates: tuple[Candidate, ...]
    """Every candidate that was simulated (the re-timed greedy results and the fitting seeds)."""
    greedy_runs: int
    """How many greedy runs were made (each policy once; none when a seed reaches `bound`)."""
    bound: float
    """A lower bound on the makespan of every schedule for these arguments (`bounds.makespan_bound`):
    the winner is optimal when it reaches it."""
    seconds: float
    """Wall time of the search."""


def check_auto(num_ranks: int, num_microbatches: int, cost: Any = None, memory_limit: Any = None,
               placement: str = "linear", stage_memory: Any = None) -> None:
    """Raise ValueError naming the first bad argument (as `auto` would)."""
    _setup(num_ranks, num_microbatches, cost, memory_limit, placement, stage_memory)


def auto(num_ranks: int, num_microbatches: int, cost: Any = None, memory_limit: Any = None,
         placement: str = "linear", stage_memory: Any = None) -> Schedule:
    """The best schedule `search` finds (see there for the arguments)."""
    return search(num_ranks, num_microbatches, cost=cost, memory_limit=memory_limit, placement=placement,
                  stage_memory=stage_memory).schedule


def search(num_ranks: int, num_microbatches: int, *, cost: Any = None, memory_limit: Any = None,
           placement: str = "linear", stage_memory: Any = None) -> SearchResult:
    """Search a schedule for P ranks and M microbatches.

    cost: a `CostModel` (default `CostModel()`); its per-stage F, B, W (stage_costs and
    stage_scale apply as in `simulate`) and message time (`comm_time`) drive the search and
    time the result. memory_limit: the most activation memory a rank may hold, one number
    for every rank or one per rank (default P). stage_memory: what one microbatch's
    activation of each stage occupies in that unit (default 1 per stage for "linear" and
    1/2 for "v": the limit counts stage-microbatches of a P-part split, so the default P is
    1F1B's peak on rank 0 under either placement). An activation is held from its F's start
    to its W's end, as `Timeline.peak_activations` counts. Raises ValueError for bad
    arguments or a limit below the smallest feasible one (named in the message). The result
    passes `verify`.
    """
    started = time.perf_counter()
    cost, table, problem = _setup(num_ranks, num_microbatches, cost, memory_limit, placement, stage_memory)
    from duplexpipe.schedules.simulate import simulate  # lazy: keeps `import registry` free of networkx
    from duplexpipe.schedules.verify import verify

    timed: list[tuple[Candidate, Schedule]] = []

    def time_it(label: str, schedule: Schedule) -> None:
        peak = max(_peaks(schedule, problem.memory))
        timed.append((Candidate(label, simulate(schedule, cost).makespan, peak), schedule))

    for label, seed in _seeds(problem, placement):
        time_it(label, seed)
    bound = makespan_bound(problem)
    optimal = any(c.makespan <= bound + 1e-9 for c, _ in timed)
    policies = [] if optimal else _policies(placement)
    found: list[tuple[float, str, Schedule]] = []
    for policy in policies:
        # The simulator can only add message waits to the greedy's own timing, so a run that
        # ends later than the best timed candidate cannot win: give it up early.
        give_up = min([c.makespan for c, _ in timed] + ([found[KEEP - 1][0]] if len(found) >= KEEP else []),
                      default=math.inf)
        result = list_schedule(problem, policy, give_up)
        if result is not None:
            found.append((result.makespan, _label(policy), _to_schedule(problem, table, result.rows)))
            found.sort(key=lambda item: item[0])
    for _, label, schedule in found[:KEEP]:
        time_it(label, schedule)
    if not timed:
        raise ValueError(f"auto found no schedule for P={num_ranks}, M={num_microbatches} under "
                         f"memory_limit {list(problem.limit)}")
    index = min(range(len(timed)), key=lambda k: (round(timed[k][0].makespan, 9), round(timed[k][0].peak, 9), k))
    winner = timed[index][1]
    schedule = Schedule(AUTO, num_ranks, num_microbatches, winner.stages, winner.actions)
    verify(schedule)  # the simulator ran it to the end already; this also proves it deadlock-free
    return SearchResult(schedule, timed[index][0], tuple(c for c, _ in timed), len(policies), bound,
                        time.perf_counter() - started)


def search_problem(num_ranks: int, num_microbatches: int, cost: Any = None, memory_limit: Any = None,
                   placement: str = "linear", stage_memory: Any = None) -> Problem:
    """The greedy's Problem for these arguments, without the feasibility check (see `smallest_limits`)."""
    return _setup(num_ranks, num_microbatches, cost, memory_limit, placement, stage_memory, check=False)[2]


def _setup(num_ranks: int, num_microbatches: int, cost: Any, memory_limit: Any, placement: Any,
           stage_memory: Any, check: bool = True) -> tuple[CostModel, tuple[StageInfo, ...], Problem]:
    """Check every argument; return the cost model, the stage table and the greedy's problem."""
    from duplexpipe.schedules.simulate import CostModel

    require_counts(AUTO, num_ranks, num_microbatches)
    if placement not in PLACEMENTS:
        raise ValueError(f"auto needs placement in {PLACEMENTS}, got placement={placement!r}")
    if cost is None:
        cost = CostModel()
    if not isinstance(cost, CostModel):
        raise ValueError(f"auto needs cost=CostModel(...), got {type(cost).__name__}")  # noqa: TRY004
    table = linear_stages(num_ranks) if placement == "linear" else v_stages(num_ranks)
    empty = Schedule(AUTO, num_ranks, num_microbatches, table, tuple(() for _ in range(num_ranks)))
    durations = cost.durations(empty)
    count = len(table)
    memory = _numbers("stage_memory", stage_memory, count, [num_ranks / count] * count, zero_ok=True)
    limit = _numbers("memory_limit", memory_limit, num_ranks, [float(num_ranks)] * num_ranks)
    problem = Problem(num_ranks, num_microbatches, tuple(info.rank for info in table), tuple(durations.f),
                      tuple(durations.i), tuple(durations.w), tuple(memory), tuple(limit), cost.comm_time)
    if check:
        _check_feasible(problem)
    return cost, table, problem


def _numbers(name: str, value: Any, count: int, default: list[float], zero_ok: bool = False) -> list[float]:
    """`value` as `count` finite numbers (> 0, or >= 0 when zero_ok): one number for all, or a sequence."""
    if value is None:
        return default
    items = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value] * count
    if len(items) != count:
        raise ValueError(f"auto needs {name} as one number or {count} numbers, got {len(items)}: {value!r}")
    for item in items:
        ok = isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item)
        if not ok or item < 0 or (item == 0 and not zero_ok):
            need = ">= 0" if zero_ok else "> 0"
            raise ValueError(f"auto needs {name} made of finite numbers {need}, got {value!r}")
    return [float(x) for x in items]


def smallest_limits(problem: Problem) -> list[float]:
    """Per rank, the smallest memory_limit `auto` accepts: one microbatch of a stage plus the reserve that
    keeps the chain moving (`Problem.reserve`)."""
    return [max(problem.memory[s] + problem.reserve(s) for s in problem.stages_of(rank))
            for rank in range(problem.num_ranks)]


def _check_feasible(problem: Problem) -> None:
    for rank, need in enumerate(smallest_limits(problem)):
        if problem.limit[rank] + 1e-9 < need:
            raise ValueError(f"auto: memory_limit {problem.limit[rank]:g} on rank {rank} is below the smallest "
                             f"feasible limit {need:g} (one microbatch in flight on each of its stages)")


POLICIES = (
    Policy(1.5, 0.0, True), Policy(1.25, 0.0, False), Policy(2.0, 0.0, True, False), Policy(1.0, 1.0, False),
    Policy(1.5, 0.0, False, False), Policy(2.0, 0.5, False, False), Policy(3.0, 0.0, False),
    Policy(1.25, 0.0, False, False), Policy(0.75, 0.0, True, False), Policy(3.0, 0.0, True),
    Policy(2.0, 1.0, False), Policy(3.0, 1.0, False, False), Policy(0.5, 0.0, True, False),
    Policy(1.5, 0.5, True, False),
)
"""The greedy's knobs, most useful first: a set cover of the policies that found the best greedy result
over P in {4, 8}, M in {2P, 4P, 8P}, four cost profiles (with and without a 1.5x last stage), limits P
and 2P and both placements (a grid of 7 alphas x 3 thetas x eager x stage order)."""


def _policies(placement: str) -> list[Policy]:
    """The policies worth running: on one stage per rank the stage order of ready Is does not matter."""
    if placement == "v":
        return list(POLICIES)
    unique = dict.fromkeys(replace(p, backward_late_first=True) for p in POLICIES)
    return list(unique)


def _label(policy: Policy) -> str:
    late = "" if policy.backward_late_first else ", I early stage first"
    return (f"greedy(alpha={policy.alpha:g}, theta={policy.theta:g}, "
            f"{'eager' if policy.eager else 'targeted'} F{late})")


def _to_schedule(problem: Problem, table: tuple[StageInfo, ...],
                 rows: tuple[tuple[tuple[str, int, int], ...], ...]) -> Schedule:
    actions = tuple(tuple(Action(s, Op(op), m) for op, s, m in row) for row in rows)
    return Schedule(AUTO, problem.num_ranks, problem.num_microbatches, table, actions)


def _seeds(problem: Problem, placement: str) -> list[tuple[str, Schedule]]:
    """The hand-made schedules of this placement whose activation peaks fit the limit."""
    from duplexpipe.schedules.generators.dualpipe import dualpipev
    from duplexpipe.schedules.generators.one_f_one_b import one_f_one_b
    from duplexpipe.schedules.generators.v_shape import v_half, v_min, v_shape
    from duplexpipe.schedules.generators.zero_bubble import zb_h1, zb_h2, zbv

    p, m = problem.num_ranks, problem.num_microbatches
    if placement == "linear":
        made = [("seed 1f1b", one_f_one_b(p, m)), ("seed zb-h1", zb_h1(p, m)), ("seed zb-h2", zb_h2(p, m))]
    else:
        made = [("seed zbv", zbv(p, m)), ("seed v-half", v_half(p, m)), ("seed v-min", v_min(p, m))] \
            if p >= 2 else []
        made += [("seed dualpipev", dualpipev(p, m))] if m >= 2 * p else []
        bound = _v_block_bound(problem)
        made += [("seed v-block", v_shape("v-block", p, m, bound))] if p >= 2 and bound >= 2 else []
    return [(label, s) for label, s in made
            if all(peak <= limit + 1e-9 for peak, limit in zip(_peaks(s, problem.memory), problem.limit,
                                                                strict=True))]


def _v_block_bound(problem: Problem) -> int:
    """The V-stage activations every rank may hold under the limit, when every stage's activation is
    the same size (else 0: no V block is seeded)."""
    if len(set(problem.memory)) != 1 or problem.memory[0] <= 0:
        return 0
    return math.floor(min(problem.limit) / problem.memory[0] + 1e-9)


def _peaks(schedule: Schedule, memory: Sequence[float]) -> list[float]:
    """Per rank: the most activation memory held at once when the list runs in order.

    The order alone decides it: a rank's earlier passes have ended before its next starts.
    """
    peaks = []
    for row in schedule.actions:
        live = peak = 0.0
        for action in row:
            for part in action.compute_parts():
                if part.op is Op.F:
                    live += memory[part.stage]
                    peak = max(peak, live)
                elif part.op in (Op.B, Op.W):
                    live -= memory[part.stage]
        peaks.append(peak)
    return peaks
