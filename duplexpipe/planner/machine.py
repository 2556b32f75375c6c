"""Simulation on a machine whose ranks share C cores (processor sharing), with per-action runtime overheads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from duplexpipe.errors import ScheduleError
from duplexpipe.planner.profile import RuntimeOverhead, check_work_terms
from duplexpipe.schedules.execute import run_program
from duplexpipe.schedules.ir import Action, Schedule
from duplexpipe.schedules.layout import Layout, gc_paused
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.program import COMPUTE, SEND, Durations, Program, analyze
from duplexpipe.schedules.simulate import CostModel
from duplexpipe.schedules.timeline import Event, Timeline
from duplexpipe.schedules.verify import explain_stuck


@dataclass(frozen=True)
class Machine:
    """What the ranks run on, beyond the cost model's compute times (all times in the cost model's unit)."""

    cores: float | None = None
    """C: cores shared by all ranks (None: a device per rank, the plain simulator's machine); a fraction where
    the ranks get a share of the cores (a pipeline of one TP coordinate: C / T). While k ranks have work, each
    progresses at rate min(1, C / k); a rank waiting for a message uses no core (gloo's waits block, they do
    not spin)."""
    action_s: float = 0.0
    """Runtime work added to every compute action (dispatch, bookkeeping), run on a core like compute."""
    message_s: float = 0.0
    """Runtime work of every SEND and every RECV (posting it, waiting on it, handing the tensor over)."""
    step_s: float = 0.0
    """Work each rank does after its list (loss, norm and optimizer bookkeeping of a step)."""
    compute_scale: float = 1.0
    """alpha: every compute action's cost-model time is multiplied by it (a part's time inside a running
    pipeline over its profiled time), before `action_s` is added."""
    wall_scale: float = 1.0
    """Every time of the simulated run is multiplied by it at the end (measured over modelled wall time of
    calibration runs: what the rest of the model leaves out)."""

    def __post_init__(self) -> None:
        if self.cores is not None and (not isinstance(self.cores, (int, float)) or isinstance(self.cores, bool)
                                       or not 0 < self.cores < math.inf):
            raise ValueError(f"cores must be a number > 0 or None (a device per rank), got {self.cores!r}")
        check_work_terms(self, "machine", ValueError)

    @staticmethod
    def of(cores: float | None, overhead: RuntimeOverhead | None) -> Machine:
        """The machine of a profile's measured runtime work (None: none) on `cores` shared cores."""
        if overhead is None:
            return Machine(cores)
        return Machine(cores, overhead.action_s, overhead.message_s, overhead.step_s, overhead.compute_scale,
                       overhead.wall_scale)


@dataclass(frozen=True)
class SharedRun:
    """A simulated step on a `Machine`."""

    timeline: Timeline
    """The compute actions as they ran (their spans include the action overhead and any slowdown)."""
    rank_end: tuple[float, ...]
    """When each rank finished its list and its step work."""

    @property
    def step(self) -> float:
        """The step's time: the last rank's end."""
        return max(self.rank_end, default=0.0)


def simulate_shared(schedule: Schedule, cost: CostModel | None = None, machine: Machine | None = None,
                    full_backward: Sequence[float] | None = None) -> SharedRun:
    """Time `schedule` (lowered first) on `machine`, event-driven over its actions and dependencies.

    As `simulate.simulate`, except that work is shared: compute actions (times `compute_scale`,
    plus `action_s`), SENDs and RECVs (`message_s` each) and the step tail (`step_s`) are work
    that progresses at min(1, C / k) while k ranks have work. A message still arrives `cost.comm_time`
    after both its SEND and its RECV are done, and waiting for it takes no core. With
    C >= num_ranks (or None) and zero overheads the timeline equals `simulate`'s.
    `full_backward`: per stage, what a full backward B costs when it differs from I + W (a fused
    pass is cheaper than two); I and W keep the cost model's b - w and w.
    """
    cost = cost if cost is not None else CostModel()
    machine = machine if machine is not None else Machine()
    lowered = lower(schedule)
    layout = Layout.of(lowered)
    durations = cost.durations(lowered)
    if full_backward is not None:
        if len(full_backward) != lowered.num_stages:
            raise ValueError(f"full_backward needs one cost per stage ({lowered.num_stages}), got {len(full_backward)}")
        for value in full_backward:
            if isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"full_backward costs must be finite numbers >= 0, got {value!r}")
        durations = Durations(durations.f, [float(v) for v in full_backward], durations.i, durations.w, durations.fb)
    program = analyze(lowered, layout, durations)
    with gc_paused():
        state = _Shared(program, layout.num_tokens, cost.comm_time, machine)
        state.run()
    if not state.finished:
        run = run_program(program, layout.num_tokens, cost.comm_time)
        raise ScheduleError("simulation stuck: " + explain_stuck(lowered, layout, program, run).message)
    k = machine.wall_scale
    events = tuple(Event(rank, action, start * k, end * k)
                   for rank, row in enumerate(state.events) for action, start, end in row)
    timeline = Timeline(schedule.name, schedule.num_ranks, schedule.num_microbatches, events)
    return SharedRun(timeline, tuple(end * k for end in state.rank_end))


class _Shared:
    """The processor-sharing run: per rank its position, and its running work (anchored at a time)."""

    def __init__(self, program: Program, num_tokens: int, comm: float, machine: Machine) -> None:
        self.program, self.comm, self.machine = program, comm, machine
        ranks = len(program)
        self.ready: list[float | None] = [None] * num_tokens
        self.posted: list[float | None] = [None] * num_tokens
        self.pos = [0] * ranks
        self.work: list[float | None] = [None] * ranks  # work left at `anchor` (None: not running)
        self.anchor = [0.0] * ranks
        self.began = [0.0] * ranks
        self.wake: list[float | None] = [None] * ranks  # when a known message arrives
        self.tail_done = [False] * ranks
        self.rank_end = [0.0] * ranks
        self.events: list[list[tuple[Action, float, float]]] = [[] for _ in range(ranks)]
        self.now, self.rate = 0.0, 1.0

    @property
    def finished(self) -> bool:
        """True when every rank ran its list and its step work."""
        return all(self.tail_done)

    def run(self) -> None:
        """Advance from event to event until no rank can move."""
        while True:
            self._start_all()
            running = [r for r, w in enumerate(self.work) if w is not None]
            wakes = [t for t in self.wake if t is not None]
            if not running and not wakes:
                return
            ends = [self.anchor[r] + self._left(r) / self.rate for r in running]
            self.now = min(ends + wakes)
            for r, end in zip(running, ends, strict=True):
                if end <= self.now:
                    self._finish(r)
            for r, t in enumerate(self.wake):
                if t is not None and t <= self.now:
                    self.wake[r] = None

    def _left(self, rank: int) -> float:
        work = self.work[rank]
        assert work is not None
        return work

    def _start_all(self) -> None:
        """Start every idle rank's next work that can start now (zero work finishes at once), then set rates."""
        moved = True
        while moved:
            moved = False
            for rank in range(len(self.program)):
                if self.work[rank] is None and self.wake[rank] is None and not self.tail_done[rank]:
                    moved |= self._try_start(rank)
        self._set_rate(sum(w is not None for w in self.work))

    def _set_rate(self, busy: int) -> None:
        cores = self.machine.cores
        rate = 1.0 if cores is None or busy <= cores else cores / busy
        if rate == self.rate:
            return
        for r, work in enumerate(self.work):  # re-anchor: the work done so far at the old rate
            if work is not None:
                self.work[r] = max(0.0, work - (self.now - self.anchor[r]) * self.rate)
                self.anchor[r] = self.now
        self.rate = rate

    def _begin(self, rank: int, work: float) -> None:
        """Run `work` on `rank` from now (`_set_rate` fixes up the rates); zero work completes at once."""
        self.began[rank] = self.now
        if work <= 0.0:
            self._finish(rank)
            return
        self.work[rank], self.anchor[rank] = work, self.now

    def _try_start(self, rank: int) -> bool:
        """Start rank's next instruction (or its step tail) if its inputs are there; True if it moved."""
        row, i = self.program[rank], self.pos[rank]
        if i == len(row):
            self.pos[rank] = i + 1
            self._begin(rank, self.machine.step_s)
            return True
        if i > len(row):
            return False
        ins = row[i]
        if ins[0] != COMPUTE:
            self._begin(rank, self.machine.message_s)
            return True
        arrival = self.now
        for token in ins[2]:
            at = self._arrival(token)
            if at is None:
                return False
            arrival = max(arrival, at)
        if arrival > self.now:
            self.wake[rank] = arrival
            return False
        self._begin(rank, ins[4] * self.machine.compute_scale + self.machine.action_s)
        return True

    def _arrival(self, token: int) -> float | None:
        """When an input is there: a local token when made, a message `comm` after its SEND and RECV."""
        if token >= 0:
            return self.ready[token]
        made, post = self.ready[-1 - token], self.posted[-1 - token]
        if made is None or post is None:
            return None
        return max(made, post) + self.comm

    def _finish(self, rank: int) -> None:
        """Complete rank's running work at `now`: record it and make its outputs available."""
        self.work[rank] = None
        row, i = self.program[rank], self.pos[rank]
        if i > len(row):
            self.tail_done[rank], self.rank_end[rank] = True, self.now
            return
        ins = row[i]
        if ins[0] == COMPUTE:
            self.events[rank].append((ins[1], self.began[rank], self.now))
            for token in ins[3]:
                self.ready[token] = self.now
        elif ins[0] == SEND:
            self.ready[ins[1]] = self.now
        else:
            self.posted[ins[1]] = self.now
        self.pos[rank] = i + 1
