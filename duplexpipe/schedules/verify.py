"""The schedule verifier: its entry points, and the cross-rank deadlock search and report."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.execute import Run, run_program
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.program import COMPUTE, SEND, SHARD, Program, analyze


def verify(schedule: Schedule, *, nccl: bool = False) -> None:
    """Raise ScheduleError unless `schedule` is complete, ordered, matched and deadlock-free.

    Checks, each error naming the actions involved: (1) completeness and placement: every
    (stage, microbatch) has one F and either one B or one I and one W, on the stage's rank,
    with F before B and F before I before W (OVERLAP_F_B pairs count as their parts);
    (2) data dependencies across stages are satisfiable; (3) for lowered schedules, sends
    and receives match one to one, with the right peer, in the same order per ordered pair
    of ranks, and each cross-rank input is received before its consumer; (4) no deadlock
    under docs/design.md's execution contract. A compute-only schedule is checked as it is, then
    lowered and the lowering checked too.

    With `nccl=True` also (5): every two ranks post the messages between them (both
    directions) in one order, as NCCL needs (`check_nccl_order`; on the lowering of a
    compute-only schedule). Off by default: the contract and gloo need only (3), and a
    schedule lowered elsewhere (an imported torch CSV) need not follow (5).
    """
    _verify_as_is(schedule)
    if schedule.has_comms:
        if nccl:
            check_nccl_order(schedule)
        return
    try:
        lowered = lower(schedule)
        _verify_as_is(lowered)
        if nccl:
            check_nccl_order(lowered)
    except ScheduleError as exc:
        raise ScheduleError(f"after lowering: {exc}") from None


def _verify_as_is(schedule: Schedule) -> None:
    layout = Layout.of(schedule)
    program = analyze(schedule, layout)
    run = run_program(program, layout.num_tokens)
    if run.finished:
        return
    raise ScheduleError(explain_stuck(schedule, layout, program, run).message)


def check_structure(schedule: Schedule) -> None:
    """Checks (1) and (3) of `verify` only: completeness, placement, order, send/receive matching."""
    analyze(schedule, Layout.of(schedule))


def check_nccl_order(schedule: Schedule) -> None:
    """Raise ScheduleError unless every two ranks post the messages between them in one order.

    On NCCL, torch runs every point-to-point op between two ranks, both directions, on one
    stream in posting order: a RECV holds that stream until its SEND runs. So rank a's
    SENDs to b and RECVs from b, in a's list order, must be the same messages in the same
    order as b's RECVs from a and SENDs to a, or the step can hang (gloo does not need
    this). Only this rule is checked, on a lowered schedule (a compute-only one has no
    messages); `verify` checks everything else. The error names both ranks, the position
    in their sequences and the two actions found there.
    """
    layout = Layout.of(schedule)
    with_peer = _messages_by_peer(schedule, layout)
    for a, b in sorted({(min(key), max(key)) for key in with_peer}):
        mine, theirs = with_peer.get((a, b), []), with_peer.get((b, a), [])
        for k in range(max(len(mine), len(theirs))):
            if k < len(mine) and k < len(theirs) and mine[k][0] == theirs[k][0]:
                continue
            rows = schedule.actions
            ops = [f"{rows[r][seq[k][1]]} (list position {seq[k][1]})" if k < len(seq)
                   else f"missing (rank {r} has only {len(seq)} ops with rank {peer})"
                   for r, peer, seq in ((a, b, mine), (b, a, theirs))]
            raise ScheduleError(
                f"{schedule.name!r}: ranks {a} and {b} disagree on the order of their messages: rank {a}'s "
                f"{_ordinal(k + 1)} op with rank {b} is {ops[0]}, rank {b}'s is {ops[1]}; on NCCL both "
                "directions between two ranks share one stream, so both must post their messages in one order")


def _messages_by_peer(schedule: Schedule, layout: Layout) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(rank, peer rank) -> (message token, position) of each SEND to / RECV from the peer, in list order."""
    nmb, count, rank_of = layout.num_microbatches, layout.num_stages, layout.rank
    half = count * nmb
    send_f, send_b, recv_f, recv_b = Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B
    found: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            op, stage, mb = action.op, action.stage, action.microbatch
            # a message's token names its receiving stage: the peer for sends, this stage for receives
            if op is send_f or op is recv_b:
                peers, offset = layout.nxt, 0 if op is send_f else half
            elif op is send_b or op is recv_f:
                peers, offset = layout.prv, half if op is send_b else 0
            else:
                continue
            peer = peers[stage] if stage < count else -1
            if peer < 0 or rank_of[peer] == rank or not 0 <= mb < nmb:
                raise ScheduleError(f"{schedule.name!r}: {action} at rank {rank}, position {pos} is not a "
                                    "message between two ranks (run verify for the full diagnosis)")
            token = offset + (peer if op is send_f or op is send_b else stage) * nmb + mb
            found.setdefault((rank, rank_of[peer]), []).append((token, pos))
    return found


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass(frozen=True)
class Deadlock:
    """Where each stuck rank stopped, and one cycle of waits among them."""

    blocked: tuple[tuple[int, Action, str, int], ...]
    """(rank, the action it is blocked at, the action it waits for, that action's rank), by rank."""
    cycle: tuple[tuple[int, tuple[Action, ...]], ...]
    """The cycle in happens-before order: (rank, its actions from where it is blocked to the one awaited)."""
    message: str
    """A human-readable report: the blocked actions, the cycle rank by rank and the rank x step grid."""


def find_deadlock(schedule: Schedule) -> Deadlock | None:
    """Execute `schedule` symbolically (compute-only or lowered, as it is); None if every rank finishes.

    Runs the structural checks first (they raise ScheduleError). The happens-before graph
    (program order on each rank, SEND -> consumer of the matching RECV, RECV -> its
    consumer, local stage handoffs) is acyclic exactly when this execution finishes;
    otherwise the stuck ranks' waits form a cycle, found with networkx on the graph of the
    blocked actions and reported as actions.
    """
    layout = Layout.of(schedule)
    program = analyze(schedule, layout)
    run = run_program(program, layout.num_tokens)
    return None if run.finished else explain_stuck(schedule, layout, program, run)


def _setters(program: Program) -> dict[int, tuple[int, int]]:
    """Wait key -> (rank, position) of the action that satisfies it (for a collective: one of its members)."""
    found: dict[int, tuple[int, int]] = {}
    for rank, row in enumerate(program):
        for pos, ins in enumerate(row):
            if ins[0] == COMPUTE:
                for token in ins[3]:
                    found[token] = (rank, pos)
            elif ins[0] == SHARD:
                if ins[2] is not None:
                    found.setdefault(ins[2], (rank, pos))
            else:
                found[ins[1] if ins[0] == SEND else -1 - ins[1]] = (rank, pos)
    return found


def _members(program: Program) -> dict[int, list[tuple[int, int]]]:
    """Collective token -> (rank, position) of every action that joins it."""
    found: dict[int, list[tuple[int, int]]] = {}
    for rank, row in enumerate(program):
        for pos, ins in enumerate(row):
            if ins[0] == SHARD and ins[2] is not None:
                found.setdefault(ins[2], []).append((rank, pos))
    return found


def explain_stuck(schedule: Schedule, layout: Layout, program: Program, run: Run) -> Deadlock:
    """Describe a stopped `run`: each stuck rank's blocked action and awaited action, and one cycle."""
    setters, rows, lowered = _setters(program), schedule.actions, schedule.has_comms
    members = _members(program)
    graph: nx.DiGraph = nx.DiGraph()
    blocked, awaited = [], {}
    for rank, row in enumerate(program):
        if run.position[rank] == len(row):
            continue
        key = run.blocked_on[rank]
        assert key is not None
        head = rows[rank][run.position[rank]]
        if key in members:  # a collective: wait for a member that has not joined it yet
            late = [(r, p) for r, p in members[key] if run.position[r] < p]
            if late:
                peer, pos = late[0]
                awaited[rank] = (peer, pos)
                graph.add_edge(rank, peer)
                blocked.append((rank, head, f"{rows[peer][pos]} (one collective with it)", peer))
            else:
                blocked.append((rank, head, f"a member of {rows[rank][run.position[rank]]}'s collective that no "
                                "rank posts", rank))
        elif key in setters:
            peer, pos = setters[key]
            awaited[rank] = (peer, pos)
            graph.add_edge(rank, peer)
            blocked.append((rank, head, str(rows[peer][pos]), peer))
        else:
            token, role = (key, "send" if lowered else "produce") if key >= 0 else (-1 - key, "recv")
            text, peer = layout.token_text(token, role)
            blocked.append((rank, head, f"{text}, which no rank posts", peer))
    try:
        edges = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        edges = []
    cycle = _cycle_segments(rows, run.position, awaited, [e[0] for e in edges])
    return Deadlock(tuple(blocked), cycle, _report(schedule, run.position, tuple(blocked), cycle))


def _cycle_segments(rows: tuple[tuple[Action, ...], ...], position: list[int],
                    awaited: dict[int, tuple[int, int]], ranks: list[int]) -> tuple:
    """Walk the wait cycle backwards so each segment ends at the action the next rank waits for."""
    if not ranks:
        return ()
    waiter_of = {awaited[r][0]: r for r in ranks}
    segments, rank = [], min(ranks)
    for _ in ranks:
        waiter = waiter_of[rank]
        stop = awaited[waiter][1]
        segments.append((rank, rows[rank][position[rank]:stop + 1]))
        rank = waiter
    return tuple(segments)


def _short(actions: tuple[Action, ...]) -> str:
    texts = [str(a) for a in actions]
    if len(texts) > 6:
        texts = texts[:2] + [f"... ({len(texts) - 4} more) ..."] + texts[-2:]
    return " -> ".join(texts)


def _report(schedule: Schedule, position: list[int], blocked: tuple[tuple[int, Action, str, int], ...],
            cycle: tuple[tuple[int, tuple[Action, ...]], ...]) -> str:
    parts = [f"rank {r} blocked at {head} waiting for {what} on rank {peer}"
             for r, head, what, peer in blocked]
    lines = [f"deadlock in {schedule.name!r}: " + "; ".join(parts)]
    if cycle:
        chain = " => ".join(f"rank {r}: {_short(seg)}" for r, seg in cycle)
        lines.append(f"cycle: {chain} => rank {cycle[0][0]}: {cycle[0][1][0]}")
    lines.append("where each stuck rank stopped ([blocked action]):")
    for r, *_ in blocked[:16]:
        row, at = schedule.actions[r], position[r]
        window = ([str(a) for a in row[max(0, at - 3):at]] + [f"[{row[at]}]"]
                  + [str(a) for a in row[at + 1:at + 4]])
        lead, tail = ("... " if at > 3 else ""), (" ..." if at + 4 < len(row) else "")
        lines.append(f"  rank {r:>3} step {at:>4}: {lead}{' '.join(window)}{tail}")
    if len(blocked) > 16:
        lines.append(f"  ... and {len(blocked) - 16} more stuck ranks")
    return "\n".join(lines)


def happens_before_graph(schedule: Schedule) -> nx.DiGraph:
    """The full happens-before graph as networkx: nodes (rank, position) with an `action` attribute.

    Edges: program order on each rank; the action that makes a tensor available (SEND, or
    the producer for a local handoff or a compute-only schedule) -> its consumer; a RECV ->
    its consumer. `find_deadlock` finds a cycle here without building it (this is the slow,
    explicit form, for tests and tools).
    """
    layout = Layout.of(schedule)
    program = analyze(schedule, layout)
    setters = _setters(program)
    graph: nx.DiGraph = nx.DiGraph()
    for rank, row in enumerate(program):
        actions = schedule.actions[rank]
        graph.add_nodes_from(((rank, pos), {"action": actions[pos]}) for pos in range(len(row)))
        graph.add_edges_from(((rank, pos), (rank, pos + 1)) for pos in range(len(row) - 1))
        for pos, ins in enumerate(row):
            if ins[0] != COMPUTE:
                continue
            for token in ins[2]:
                for key in (token,) if token >= 0 else (-1 - token, token):
                    if key in setters:
                        graph.add_edge(setters[key], (rank, pos))
    return graph
