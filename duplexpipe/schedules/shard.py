"""ZeRO-3 in the schedule: the pass that adds UNSHARD, RESHARD and REDUCE_GRAD to any schedule, and its episodes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import Action, Op, Schedule

__all__ = ["Episode", "add_unshard_reshard", "episodes", "grad_reductions", "gradient_deltas", "gradient_peak",
           "residency", "windows_gradients", "weight_group_ranks"]


@dataclass(frozen=True)
class Episode:
    """One stretch of a stage's parameters unsharded on its rank: its UNSHARD, the run of the stage's compute, its
    RESHARD. Positions index the rank's list of compute actions (UNSHARD and RESHARD sit between computes)."""

    stage: int
    """The stage whose parameters are gathered."""
    issue: int
    """The compute before which the UNSHARD is issued (its all-gather runs beside computes issue..first_use-1)."""
    first_use: int
    """The first compute of the episode that needs the stage."""
    last_use: int
    """The last compute of the episode; the RESHARD follows it."""


def add_unshard_reshard(schedule: Schedule, window: int, lookahead: int = 1, dp: int | None = None,
                        reshard_gradients: bool | None = None) -> Schedule:
    """`schedule` with ZeRO-3's UNSHARD, RESHARD and REDUCE_GRAD actions, for any schedule (compute-only or lowered).

    Per rank, over its compute actions in list order:

    - at most `window` of the rank's stages are unsharded at once: an F&B pair of more stages than that (two, under
      a window of 1) runs as its two parts one after the other, each holding its own stage (the pair's overlap is
      the price of the window). An episode is an UNSHARD, a run of
      the stage's computes, a RESHARD. Which stage to reshard when room is needed is the one needed again furthest
      ahead (Belady's rule: the fewest all-gathers a window allows); a stage not needed again in the step is
      resharded right after its last compute. A window holding all of a rank's stages gives one episode per stage.
    - each UNSHARD is issued `lookahead` compute actions before the episode's first compute (so its all-gather runs
      beside them), later where the window is full until a RESHARD makes room, never before the stage's previous
      RESHARD or the start of the list; lookahead 0 issues it right before its first compute.
    - REDUCE_GRAD: with a window holding all of a rank's stages, one per stage, right after the compute that ends
      its last B or W; with a smaller window, when `reshard_gradients` is True or, None, where that holds fewer
      gradient bytes (`windows_gradients`: not at dp=2 with two stages per rank, where a whole gradient and the
      shards weigh as much as two whole ones; always when `dp` is None), one
      after every episode that ran a B or W of the stage, right before that episode's RESHARD (the gradients are
      windowed with the parameters: each reduction reduce-scatters what the episode accumulated and adds it into the
      stage's sharded gradient, `grad_reductions`). For a weight group
      with copies on several ranks (DualPipe), whose gradient sum joins those ranks in one collective, one per
      step at the end of each list in weight-group order (the order every member issues them in).

    New actions go right after the previous compute and the SENDs that follow it (before the RECVs of the next
    compute); at one spot: REDUCE_GRADs, RESHARDs, then UNSHARDs. Raises ValueError for a window below 1 or above
    the most stages a rank holds, or a negative lookahead, and ScheduleError for a schedule that already holds
    these actions (`Schedule.without_fsdp`).
    """
    most = max(len(schedule.stages_of_rank(r)) for r in range(schedule.num_ranks))
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= most:
        raise ValueError(f"reshard window must be a whole number of stages from 1 to {most} (the most stages a rank "
                         f"of {schedule.name!r} holds), got {window!r}")
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"unshard lookahead must be a whole number of compute actions >= 0, got {lookahead!r}")
    if schedule.has_fsdp:
        raise ScheduleError(f"{schedule.name!r} already holds UNSHARD/RESHARD/REDUCE_GRAD actions; lower "
                            "schedule.without_fsdp() to choose another window")
    joint = {s for s, ranks in enumerate(weight_group_ranks(schedule)) if len(ranks) > 1}
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
        raise ValueError(f"dp must be a whole number of data-parallel replicas >= 1 (or None), got {dp!r}")
    rows = tuple(_rank_row(schedule, _split_pairs(row, window), window, lookahead, joint,
                           windows_gradients(len(schedule.stages_of_rank(r)), window, dp, reshard_gradients))
                 for r, row in enumerate(schedule.actions))
    return Schedule(schedule.name, schedule.num_ranks, schedule.num_microbatches, schedule.stages, rows)


def windows_gradients(stages: int, window: int, dp: int | None, chosen: bool | None = None) -> bool:
    """Whether a rank of `stages` stages under a reshard `window` reduces its gradients after each episode: only
    where the window is smaller than its stages, then as `chosen` says (DataParallelConfig.reshard_gradients) or,
    None, where (`dp` known) a whole gradient per windowed stage beside every stage's 1/dp shard counts fewer
    stage-sized gradients than keeping all of them whole (window + stages/dp < stages)."""
    if window >= stages:
        return False
    return chosen if chosen is not None else dp is None or window * dp + stages < stages * dp


def weight_group_ranks(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per stage: the ranks holding a copy of its weight group (model part), sorted; one rank except DualPipe's."""
    by_group: dict[int, set[int]] = {}
    for info in schedule.stages:
        by_group.setdefault(info.group, set()).add(info.rank)
    return tuple(tuple(sorted(by_group[info.group])) for info in schedule.stages)


def episodes(schedule: Schedule) -> dict[int, int]:
    """Per stage: its residency episodes in one step, the UNSHARD actions (all-gathers) of `schedule` (0 without)."""
    return _count(schedule, Op.UNSHARD)


def grad_reductions(schedule: Schedule) -> dict[int, int]:
    """Per stage: its REDUCE_GRAD actions (gradient reduce-scatters) in one step of `schedule` (0 without)."""
    return _count(schedule, Op.REDUCE_GRAD)


def _count(schedule: Schedule, op: Op) -> dict[int, int]:
    counts = dict.fromkeys(range(schedule.num_stages), 0)
    for _, _, action in schedule.iter_actions():
        if action.op is op:
            counts[action.stage] += 1
    return counts


def gradient_deltas(timed: Iterable[tuple[Action, float, float]], whole: Sequence[float],
                    shard: Sequence[float]) -> list[tuple[float, float]]:
    """The gradient bytes a rank holds, as (time, bytes added), from its list's actions in order with their (start,
    end): a stage's unreduced gradient (`whole[stage]` bytes) is taken at the start of its first B or W since its
    last REDUCE_GRAD (or the step's start) and freed at the end of the next REDUCE_GRAD, the stage's first of the
    step leaving its reduced shard (`shard[stage]`; the later ones add into it). One REDUCE_GRAD per stage: whole
    from the first gradient to the step's reduction; a windowed pass (`add_unshard_reshard`): whole only through
    the episodes that make it; none: whole to the end."""
    dirty: set[int] = set()
    reduced: set[int] = set()
    out: list[tuple[float, float]] = []
    for action, start, end in timed:
        if action.op.is_compute:
            for part in action.compute_parts():
                if (part.op is Op.B or part.op is Op.W) and part.stage not in dirty:
                    dirty.add(part.stage)
                    out.append((start, float(whole[part.stage])))
        elif action.op is Op.REDUCE_GRAD and action.stage in dirty:
            stage = action.stage
            dirty.discard(stage)
            out.append((end, (0.0 if stage in reduced else float(shard[stage])) - whole[stage]))
            reduced.add(stage)
    return out


def gradient_peak(schedule: Schedule, rank: int, whole: Sequence[float], shard: Sequence[float]) -> float:
    """The most gradient bytes `rank` holds at once over its list (`gradient_deltas`, sampled after each action)."""
    live = peak = 0.0
    for _, delta in gradient_deltas(((a, float(i), float(i)) for i, a in enumerate(schedule.actions[rank])),
                                    whole, shard):
        live += delta
        peak = max(peak, live)
    return peak


def residency(schedule: Schedule, rank: int) -> list[int]:
    """How many stages `rank` holds unsharded during each of its compute actions, in list order (all of its stages
    throughout when the schedule has no UNSHARD/RESHARD)."""
    if not any(a.op is Op.UNSHARD or a.op is Op.RESHARD for row in schedule.actions for a in row):
        return [len(schedule.stages_of_rank(rank))] * sum(a.op.is_compute for a in schedule.actions[rank])
    live: set[int] = set()
    out = []
    for action in schedule.actions[rank]:
        if action.op is Op.UNSHARD:
            live.add(action.stage)
        elif action.op is Op.RESHARD:
            live.discard(action.stage)
        elif action.op.is_compute:
            out.append(len(live))
    return out


def _split_pairs(row: tuple[Action, ...], window: int) -> tuple[Action, ...]:
    """`row` with each F&B pair that needs more stages than `window` replaced by its parts, in place (its receives
    stay before the forward and its sends after the backward, so the messages keep their order)."""
    out: list[Action] = []
    for action in row:
        stages = {p.stage for p in action.compute_parts()}
        out += action.compute_parts() if action.op is Op.OVERLAP_F_B and len(stages) > window else (action,)
    return tuple(out)


def _rank_row(schedule: Schedule, row: tuple[Action, ...], window: int, lookahead: int,
              joint: set[int], windowed: bool) -> tuple[Action, ...]:
    """One rank's list with its UNSHARD, RESHARD and REDUCE_GRAD actions."""
    where = [pos for pos, action in enumerate(row) if action.op.is_compute]
    if not where:
        return row
    needs = [tuple(dict.fromkeys(p.stage for p in row[pos].compute_parts())) for pos in where]
    found = _plan(needs, window, lookahead)
    grads = [{p.stage for p in row[pos].compute_parts() if p.op is Op.B or p.op is Op.W} for pos in where]
    last_grad = {stage: c for c, stages in enumerate(grads) for stage in stages}
    spots: dict[int, tuple[list[Action], list[Action], list[Action]]] = {}

    def at(c: int, kind: int) -> list[Action]:
        return spots.setdefault(c, ([], [], []))[kind]
    if windowed:  # windowed gradients: one per episode with a B or W
        reduce_at = [(ep.last_use + 1, ep.stage) for ep in found if ep.stage not in joint
                     and any(ep.stage in grads[c] for c in range(ep.first_use, ep.last_use + 1))]
    else:
        reduce_at = [(last_grad[s] + 1, s) for s in last_grad if s not in joint]
    for c, stage in sorted(reduce_at, key=lambda cs: (cs[0], cs[1])):
        at(c, 0).append(Action.on_stage(stage, Op.REDUCE_GRAD))
    for ep in sorted(found, key=lambda e: (e.last_use, e.stage)):
        at(ep.last_use + 1, 1).append(Action.on_stage(ep.stage, Op.RESHARD))
    for ep in found:  # by first use: the issue order follows the order of use
        at(ep.issue, 2).append(Action.on_stage(ep.stage, Op.UNSHARD))
    out: list[Action] = []
    done = 0
    for c in sorted(spots):
        spot = 0 if c == 0 else _after_sends(row, where[c - 1])
        out += row[done:spot]
        for group in spots[c]:
            out += group
        done = spot
    out += row[done:]
    out += [Action.on_stage(s, Op.REDUCE_GRAD)
            for s in sorted((s for s in last_grad if s in joint), key=lambda s: (schedule.stages[s].group, s))]
    return tuple(out)


def _after_sends(row: tuple[Action, ...], pos: int) -> int:
    """The position right after the compute at `pos` and the SENDs that follow it."""
    pos += 1
    while pos < len(row) and row[pos].op in (Op.SEND_F, Op.SEND_B):
        pos += 1
    return pos


def _plan(needs: list[tuple[int, ...]], window: int, lookahead: int) -> list[Episode]:
    """The episodes of one rank whose computes need the stages `needs[c]`, ordered by first use."""
    spans = _belady(needs, window)
    count = [0] * len(needs)
    for _, first, last in spans:
        for t in range(first, last + 1):
            count[t] += 1
    previous_end: dict[int, int] = {}
    out = []
    for stage, first, last in spans:
        lowest = max(first - lookahead, previous_end.get(stage, -1) + 1, 0)
        issue = first
        while issue - 1 >= lowest and count[issue - 1] < max(window, len(needs[issue - 1])):
            issue -= 1
        for t in range(issue, first):
            count[t] += 1
        previous_end[stage] = last
        out.append(Episode(stage, issue, first, last))
    return out


def _belady(needs: list[tuple[int, ...]], window: int) -> list[tuple[int, int, int]]:
    """(stage, first use, last use) of each episode, by first use: at most max(window, stages a compute needs)
    resident at each compute, evicting the stage needed again furthest ahead; a stage is dropped after its last use."""
    uses: dict[int, list[int]] = {}
    for c, stages in enumerate(needs):
        for s in stages:
            uses.setdefault(s, []).append(c)
    cursor = dict.fromkeys(uses, 0)
    live: dict[int, list[int]] = {}  # stage -> its open span [first, last] in `spans`
    spans: list[list[int]] = []
    for c, need in enumerate(needs):
        for s in need:
            cursor[s] += 1  # uses[s][cursor[s]] is now the next use after c
        cap = max(window, len(need))
        while len(live.keys() | set(need)) > cap:
            victim = max((s for s in live if s not in need),
                         key=lambda s: (uses[s][cursor[s]] if cursor[s] < len(uses[s]) else math.inf, -s))
            del live[victim]
        for s in need:
            if s in live:
                live[s][2] = c
            else:
                live[s] = [s, c, c]
                spans.append(live[s])
        for s in need:
            if cursor[s] == len(uses[s]):
                del live[s]
    return [(s, first, last) for s, first, last in spans]
