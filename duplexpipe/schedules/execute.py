"""Execute compiled per-rank programs under the execution contract: the engine under the verifier, the lowering
and the simulator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from duplexpipe.schedules.ir import Action
from duplexpipe.schedules.program import COMPUTE, SEND, SHARD, Instruction, Program


@dataclass
class Run:
    """The result of executing a program: times, and where each rank stopped."""

    events: list[list[tuple[Action, float, float]]]
    """events[r]: rank r's (compute action, start, end) in list order (empty unless recorded)."""
    position: list[int]
    """position[r]: how many of rank r's actions ran (all of them unless stuck)."""
    blocked_on: list[int | None]
    """blocked_on[r]: what rank r waits for: a token (its data), or -1-token (its local RECV)."""
    finished: bool
    """True when every rank ran its whole list."""
    collectives: list[list[tuple[Action, float, float]]] = field(default_factory=list)
    """collectives[r]: rank r's (UNSHARD, RESHARD or REDUCE_GRAD, start, end) in list order, a collective from when
    it starts on the lanes to when it completes, a RESHARD at the time it runs (empty unless recorded)."""


def _start_time(inputs: Sequence[int], now: float, ready: list[float | None], posted: list[float | None],
                comm: float) -> tuple[float, int | None]:
    """(when a compute with these input tokens can start on a rank free at `now`, None) or (now, the token it
    waits for). A token >= 0 is local; -1-t is message t, which arrives `comm` after both its send and its
    receive are posted."""
    start = now
    for token in inputs:
        if token >= 0:
            at = ready[token]
            if at is None:
                return now, token
        else:
            at, post = ready[-1 - token], posted[-1 - token]
            if at is None or post is None:
                return now, (-1 - token if at is None else token)
            at = (at if at > post else post) + comm
        if at > start:
            start = at
    return start, None


def run_program(program: Program, num_tokens: int, comm: float = 0.0, record: bool = False,
                all_posted: bool = False) -> Run:
    """Execute `program` under the execution contract; stops (never loops) when no rank can move.

    Each rank runs in order; RECV/SEND take no rank time; a message arrives `comm` after
    both its SEND and its RECV are posted; a compute starts once the rank is free and its
    inputs have arrived. A collective (UNSHARD, REDUCE_GRAD) holds its rank until every member
    has joined it (a rendezvous: a blocking collective, the conservative contract), then runs
    on the members' data-parallel lanes while the rank goes on; a compute that needs an
    UNSHARD waits for its end. A stuck rank is woken only by what it waits for, so this takes
    time linear in the number of actions. `all_posted`: every RECV counts as posted at
    time 0, so a program may name messages without RECV instructions.
    """
    num_ranks = len(program)
    ready: list[float | None] = [None] * num_tokens
    posted: list[float | None] = [0.0 if all_posted else None] * num_tokens
    waiting: dict[int, list[int]] = {}
    position, clock = [0] * num_ranks, [0.0] * num_ranks
    blocked_on: list[int | None] = [None] * num_ranks
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_ranks)]
    shards = _Collectives(num_ranks, ready, waiting)
    todo = list(range(num_ranks - 1, -1, -1))
    while todo:
        rank = todo.pop()
        row, i, now, wait = program[rank], position[rank], clock[rank], None
        end, log = len(row), events[rank]
        while i < end:
            ins = row[i]
            kind = ins[0]
            if kind == COMPUTE:
                start, wait = _start_time(ins[2], now, ready, posted, comm)
                if wait is not None:
                    break
                now = start + ins[4]
                if record:
                    log.append((ins[1], start, now))
                for token in ins[3]:
                    ready[token] = now
                    if token in waiting:
                        todo.extend(waiting.pop(token))
            elif kind == SHARD:
                now, wait = shards.join(rank, i, ins, now, todo)
                if wait is not None:
                    break
            else:
                token = ins[1]
                if kind == SEND:
                    ready[token] = now
                else:
                    posted[token] = now
                    token = -1 - token
                if token in waiting:
                    todo.extend(waiting.pop(token))
            i += 1
        position[rank], clock[rank], blocked_on[rank] = i, now, wait
        if wait is not None:
            waiting.setdefault(wait, []).append(rank)
    finished = all(position[r] == len(row) for r, row in enumerate(program))
    return Run(events, position, blocked_on, finished, shards.spans(program, position) if record else [])


class _Collectives:
    """The collectives of one `run_program`: who joined which, when each met, when each lane is free."""

    def __init__(self, num_ranks: int, ready: list[float | None], waiting: dict[int, list[int]]) -> None:
        self.ready, self.waiting = ready, waiting
        self.joined = [-1] * num_ranks
        """joined[r]: the position of the collective rank r last joined (joins once, though woken again)."""
        self.left: dict[int, int] = {}
        """token -> members still to join."""
        self.met: dict[int, float] = {}
        """token -> the latest time a member joined (when the last joins: the rendezvous)."""
        self.started: dict[int, float] = {}
        """token -> when the collective started on its lanes."""
        self.lane = [0.0] * num_ranks
        """lane[r]: when rank r's data-parallel lane is free."""
        self.resharded: dict[tuple[int, int], float] = {}
        """(rank, position) -> when a RESHARD ran."""

    def join(self, rank: int, pos: int, ins: Instruction, now: float, todo: list[int]) -> tuple[float, int | None]:
        """Rank `rank` reaches the SHARD instruction `ins` at `now`: (its clock after, or the token it waits for)."""
        token = ins[2]
        if token is None:
            self.resharded[(rank, pos)] = now
            return now, None
        ready = self.ready
        if self.joined[rank] != pos:
            self.joined[rank] = pos
            if token >= len(ready):
                ready.extend([None] * (token + 1 - len(ready)))
            self.met[token] = max(self.met.get(token, now), now)
            left = self.left.get(token, ins[3]) - 1
            self.left[token] = left
            if left == 0:
                start = max([self.met[token]] + [self.lane[r] for r in ins[4]])
                for r in ins[4]:
                    self.lane[r] = start + ins[5]
                self.started[token], ready[token] = start, start + ins[5]
                if token in self.waiting:
                    todo.extend(self.waiting.pop(token))
        if ready[token] is None:
            return now, token
        met = self.met[token]
        return (met if met > now else now), None

    def spans(self, program: Program, position: list[int]) -> list[list[tuple[Action, float, float]]]:
        """Per rank: (action, start, end) of each SHARD instruction it ran."""
        out: list[list[tuple[Action, float, float]]] = []
        for rank, row in enumerate(program):
            mine: list[tuple[Action, float, float]] = []
            for pos in range(position[rank]):
                ins = row[pos]
                if ins[0] != SHARD:
                    continue
                token = ins[2]
                if token is None:
                    at = self.resharded[(rank, pos)]
                    mine.append((ins[1], at, at))
                elif self.ready[token] is not None:
                    end = self.ready[token]
                    assert end is not None
                    mine.append((ins[1], self.started[token], end))
            out.append(mine)
        return out
