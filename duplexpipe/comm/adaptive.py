"""The adaptive-compression controller: per key (a gradient bucket or a stage link), a rung of a ladder of codecs
moved up while its communication is exposed and down while it is hidden, from measurements every rank shares."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from duplexpipe.dp_options.compression import AdaptiveOptions

LOG = logging.getLogger("duplexpipe.adaptive")
"""Every decision is logged here (INFO), on every rank alike."""
EMA_BETA = 0.9
"""Weight of the past in the loss guard's moving average."""
GUARD_WARMUP = 10
"""Steps the loss guard watches before it may act (the first losses fall fast and say nothing of the codec)."""


@dataclass(frozen=True)
class Decision:
    """One move of one key."""

    step: int
    """The controller's step count when it was made (the rung applies from the next step)."""
    key: str
    """The bucket ("bucket 3") or link ("link 0->1") that moved."""
    before: str
    """Its rung before (as written in the ladder)."""
    after: str
    """Its rung from the next step on."""
    reason: str
    """Why: exposed, hidden or the loss guard, with the measured figures."""

    def __str__(self) -> str:
        return f"step {self.step}: {self.key} {self.before} -> {self.after} ({self.reason})"


@dataclass(frozen=True)
class CompressionReport:
    """What adaptive compression measured and chose in one step (`pipe.last.compression`)."""

    choices: Mapping[str, str]
    """Key -> the rung it used in this step."""
    exposed_s: Mapping[str, float]
    """Key -> its exposed seconds in this step on this rank (the group's maximum of them decides, at the end of
    the next step)."""
    decisions: tuple[Decision, ...] = ()
    """The moves made at the end of this step, from the previous step's agreed measurements (they apply from the
    next step)."""
    controller_s: float = 0.0
    """Seconds this rank spent on the controller in this step: posting the agreement, completing it, deciding."""
    controller_cpu_s: float = 0.0
    """The CPU seconds of this rank's thread in the same (`time.thread_time`: without the time a loaded machine
    kept it waiting for a core)."""


def merged_reports(*reports: CompressionReport | None) -> CompressionReport | None:
    """One report of several controllers' (gradient buckets and stage links); None when there is none."""
    found = [r for r in reports if r is not None]
    if not found:
        return None
    return CompressionReport({k: v for r in found for k, v in r.choices.items()},
                             {k: v for r in found for k, v in r.exposed_s.items()},
                             tuple(d for r in found for d in r.decisions), sum(r.controller_s for r in found),
                             sum(r.controller_cpu_s for r in found))


@dataclass(frozen=True)
class ExposureReport:
    """Exposed communication of one step on this rank (`pipe.last.exposure`)."""

    buckets: Mapping[int, float]
    """Data-parallel bucket index -> seconds from the end of the window's compute (after the last W feeding it)
    until its reduction completed; 0 when it had completed before the step waited for it."""
    links: Mapping[str, float]
    """Stage link "link a->b" (pipeline ranks, b this one) -> seconds this rank's receives from a waited beyond the
    sender's compute: each wait counted from when a posted the message, if later than when b began waiting (with
    p2p_compression="adaptive" or an emulated link, whose messages carry that time; otherwise the whole wait, an
    upper bound that also covers the sender's compute running late)."""

    @property
    def total_s(self) -> float:
        """All of it, in seconds."""
        return sum(self.buckets.values()) + sum(self.links.values())


IMPROVEMENT = 0.9
"""A move up is kept when the median exposed seconds over the next `patience` steps are at most this fraction of
the median over the exposed steps before it (medians: one step a loaded machine stalled decides nothing)."""
URGENT = 5.0
"""A key exposed more than this many times `up` of the step in URGENT_RUN steps in a row moves up without waiting
out its patience: on a link that just became slow each step waited costs the full transfer, more than a wrong
move's trial."""
URGENT_RUN = 2
"""Steps in a row a key must be urgently exposed (one alone is noise)."""


def _medians(pairs: Sequence[Sequence[float]]) -> tuple[float, float]:
    """The medians of [group exposed seconds, step seconds] pairs; zeros for none."""
    if not pairs:
        return 0.0, 0.0
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


@dataclass
class _Key:
    rung: int
    exposed_run: int = 0
    urgent_run: int = 0
    hidden_run: int = 0
    hold: int = 1
    last_down: int | None = None
    recent: list[float] = field(default_factory=list)
    before_up: float | None = None
    up_at: int | None = None
    before_group: float | None = None
    before_step: float | None = None
    watch: list[list[float]] | None = None
    cap: int = -1
    cap_until: int = 0
    cap_hold: int = 1
    cap_level: float = 0.0
    blind: int = 0


@dataclass
class _Guard:
    ema: float | None = None
    lowest: float | None = None
    seen: int = 0

    def rose(self, loss: float, limit: float) -> bool:
        """Take one loss; True when its moving average rose more than `limit` (relative) above its lowest."""
        self.ema = loss if self.ema is None else EMA_BETA * self.ema + (1 - EMA_BETA) * loss
        self.seen += 1
        if self.seen < GUARD_WARMUP or limit <= 0:
            return False
        if self.lowest is None or self.ema < self.lowest:
            self.lowest = self.ema
            return False
        if self.ema > self.lowest * (1 + limit) + 1e-12:
            self.lowest = self.ema  # the next closure needs another rise of `limit`
            return True
        return False


@dataclass
class Controller:
    """Deterministic rung choices for a fixed set of keys: feed it the same measurements on every rank of a group
    (`observe`) and every rank makes the same moves at the same step.

    A key is exposed in a step when its exposed seconds exceed `up` x the step's seconds, hidden when they are at
    most `down` x; after `patience` exposed steps in a row (or URGENT_RUN steps exposed over URGENT x `up`) it
    moves one rung up (more compression), after `hold` hidden steps one rung down. `hold` starts at `patience` and
    doubles (up to `max_hold`) each time a move down is undone by a move up within 2 x patience steps (a failed
    probe: the lighter rung was exposed), and returns to `patience` once a move down holds for 4 x hold steps. A
    move up is judged after `patience` steps: unless the median of its exposed seconds fell below IMPROVEMENT x
    that before it (a codec whose own compute costs what its bytes save), the key goes back down and may not climb
    past that rung for a while (doubling, up to `max_hold` steps); kept while the key is still exposed, it climbs
    the next rung at once. A move down is judged too, on the group's exposed seconds (the largest of any key: the
    reductions of a group queue on one link): when they rose past what IMPROVEMENT allows and above `up`, the key
    goes back up (a hidden bucket's bytes delayed the ones behind it) and its hold doubles. The loss guard lowers
    the top rung allowed for every key."""

    options: AdaptiveOptions
    keys: Sequence[str]
    lag: int = 0
    """Observations that still predate a move when they arrive (the agreement's delay: 1), skipped for the key."""
    shared: bool = False
    """The keys' transfers queue on one link (a group's gradient buckets): a key counts as exposed by the group's
    exposed seconds (the largest of any key) when they exceed its own, since its bytes delay the step's wait
    whichever bucket shows it; False: independent keys (stage links, each its own wire)."""
    steps: int = 0
    """Observed steps."""
    ceiling: int = -1
    """The highest rung allowed (the guard lowers it); -1 at construction: the ladder's top."""
    log: list[Decision] = field(default_factory=list)
    """Every decision so far."""
    _state: dict[str, _Key] = field(default_factory=dict)
    _guard: _Guard = field(default_factory=_Guard)
    _group: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        labels = self.options.rung_labels
        if self.ceiling < 0:
            self.ceiling = len(labels) - 1
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"adaptive controller keys must be distinct, got {list(self.keys)}")
        start = min(self.options.start_rung, self.ceiling)
        patience = self.options.patience
        self._state = {k: _Key(start, hold=patience, cap=self.ceiling, cap_hold=patience) for k in self.keys}

    @property
    def labels(self) -> tuple[str, ...]:
        """The ladder's rungs as written."""
        return self.options.rung_labels

    def rung(self, key: str) -> int:
        """The rung `key` uses now."""
        return self._state[key].rung

    def rungs(self) -> list[int]:
        """Every key's rung, in key order."""
        return [self._state[k].rung for k in self.keys]

    def choices(self) -> dict[str, str]:
        """Key -> its rung's label."""
        return {k: self.labels[self._state[k].rung] for k in self.keys}

    def observe(self, step_s: float, exposed_s: Mapping[str, float], loss: float | None = None) -> list[Decision]:
        """Take one step's agreed measurements (seconds of the step, exposed seconds per key, the step's loss);
        return (and log) the moves, which apply from the next step."""
        missing = sorted(set(self.keys) - set(exposed_s))
        if missing:
            raise ValueError(f"adaptive controller: no exposure measured for {missing}")
        self.steps += 1
        moves: list[Decision] = []
        if loss is not None and self._guard.rose(float(loss), self.options.guard):
            moves += self._close_top()
        group = max((exposed_s[k] for k in self.keys), default=0.0)
        self._group = (self._group + [[group, step_s]])[-self.options.patience:]
        for key in self.keys:
            move = self._one(key, exposed_s[key], step_s, group)
            if move is not None:
                moves.append(move)
        for move in moves:
            LOG.info("adaptive compression, %s", move)
        self.log += moves
        return moves

    def _close_top(self) -> list[Decision]:
        top = max(s.rung for s in self._state.values())
        if top == 0:
            return []
        self.ceiling = min(self.ceiling, top - 1)
        moves = []
        for key, state in self._state.items():
            if state.rung > self.ceiling:
                state.up_at, state.watch = None, None
                moves.append(self._move(key, state, self.ceiling, f"loss guard: loss average rose over "
                                        f"{self.options.guard:.0%} above its lowest; rungs above "
                                        f"{self.labels[self.ceiling]} closed"))
        return moves

    def _one(self, key: str, exposed: float, step_s: float, group: float) -> Decision | None:
        opts, state = self.options, self._state[key]
        if state.blind > 0:  # measured before the key's last move took effect
            state.blind -= 1
            return None
        level = max(exposed, group) if self.shared else exposed
        share = level / step_s if step_s > 0 else 0.0
        if share > opts.up:
            state.exposed_run, state.hidden_run = state.exposed_run + 1, 0
        elif share <= opts.down:
            state.exposed_run, state.hidden_run = 0, state.hidden_run + 1
        else:
            state.exposed_run = state.hidden_run = 0
        state.urgent_run = state.urgent_run + 1 if share > URGENT * opts.up else 0
        state.recent = (state.recent + [exposed])[-opts.patience:]
        if state.cap_until and self.steps >= state.cap_until:
            state.cap, state.cap_until = len(self.labels) - 1, 0
        if state.last_down is not None and self.steps - state.last_down > 4 * state.hold:
            state.hold, state.last_down = opts.patience, None  # the last probe held
        if state.watch is not None:  # a move on trial: the group's exposed seconds and the step's since the move
            state.watch.append([group, step_s])
        if state.up_at is not None:
            if len(state.recent) < opts.patience:
                return None  # the move up is on trial
            return self._judge(key, state, share, level)
        if state.watch is not None and len(state.watch) >= opts.patience:
            undo = self._judge_down(key, state, step_s)
            if undo is not None:
                return undo
        if self._wants_up(state, level):
            return self._up(key, state, share)
        if state.hidden_run >= state.hold and state.rung > 0:
            state.last_down = self.steps
            self._on_trial(state)
            return self._move(key, state, state.rung - 1, f"hidden ({share:.1%} of the step) for {state.hold} steps")
        return None

    def _on_trial(self, state: _Key) -> None:
        """Start watching the group's exposed seconds and the step's against their medians over the last `patience`
        steps."""
        state.watch, (state.before_group, state.before_step) = [], _medians(self._group)

    def _judge_down(self, key: str, state: _Key, step_s: float) -> Decision | None:
        """After a move down's trial: undo it (and wait twice as long before the next probe) when the group's
        exposed time rose: the key's own wait stayed hidden, but its bytes delayed the reductions queued behind
        it on the same link."""
        opts, before, step_before = self.options, state.before_group or 0.0, state.before_step or 0.0
        after, step_after = _medians(state.watch or [])
        state.watch, state.before_group, state.before_step = None, None, None
        if (after * IMPROVEMENT <= before or after <= opts.up * step_s or step_after <= step_before
                or state.rung >= min(self.ceiling, state.cap)):
            return None
        state.hold, state.last_down = min(2 * state.hold, opts.max_hold), None
        return self._move(key, state, state.rung + 1, f"the group's exposed time rose on {self.labels[state.rung]} "
                          f"({after * 1e3:.2f} ms vs {before * 1e3:.2f} ms) and the step's ({step_after * 1e3:.2f} ms "
                          f"vs {step_before * 1e3:.2f} ms); next probe after {state.hold} hidden steps")

    def _wants_up(self, state: _Key, level: float) -> bool:
        """Exposed for `patience` steps in a row (or urgently for URGENT_RUN), with a rung above it open: urgent
        exposure (`level`: the exposed seconds now) over twice what the key saw before a failed trial opens the rung
        that trial capped (the link changed since, perhaps during the trial)."""
        urgent = state.urgent_run >= URGENT_RUN
        pressed = state.exposed_run >= self.options.patience or urgent
        changed = urgent and level > 2 * state.cap_level
        return pressed and state.rung < min(self.ceiling, len(self.labels) - 1 if changed else state.cap)

    def _up(self, key: str, state: _Key, share: float) -> Decision:
        """Move one rung up and put the move on trial against the median of the exposed steps that asked for it."""
        opts = self.options
        if state.last_down is not None and self.steps - state.last_down <= 2 * opts.patience:
            state.hold = min(2 * state.hold, opts.max_hold)
        run = max(1, min(len(state.recent), state.exposed_run))
        state.last_down, state.up_at = None, self.steps
        state.before_up = statistics.median(state.recent[-run:])
        self._on_trial(state)
        urgent = state.exposed_run < opts.patience
        why = (f"exposed {share:.1%} of the step (over {URGENT * opts.up:.0%}) for {state.urgent_run} steps" if urgent
               else f"exposed {share:.1%} of the step for {state.exposed_run} steps")
        return self._move(key, state, state.rung + 1, why)

    def _judge(self, key: str, state: _Key, share: float, level: float) -> Decision | None:
        """After a move up's trial: keep it if it lowered the key's exposed seconds or the group's (reductions queue
        on one link: a bucket whose second collective waits behind the others' shows their transfers as its own),
        and climb on at once while the key is still exposed; else go back and cap the key."""
        opts, before = self.options, state.before_up or 0.0
        after = statistics.median(state.recent)
        group_before, step_before = state.before_group or 0.0, state.before_step or 0.0
        group_after, step_after = _medians(state.watch or [])
        lowered = after <= IMPROVEMENT * before or group_after <= IMPROVEMENT * group_before
        slower = step_after > step_before  # the codec's own compute cost more than the transfer it saved
        state.up_at, state.before_up, state.watch, state.before_group, state.before_step = None, None, None, None, None
        if lowered and not slower:
            state.cap_hold = opts.patience
            return self._up(key, state, share) if self._wants_up(state, level) else None
        # re-armed by exposure over twice what the rung below saw before the trial, not during it: a link that
        # dropped mid-trial makes the trial look failed and the rung below far more exposed than it was
        state.cap, state.cap_level = state.rung - 1, max(before, group_before)
        state.cap_until = self.steps + state.cap_hold
        state.cap_hold = min(2 * state.cap_hold, opts.max_hold)
        what = (f"made the step slower ({step_after * 1e3:.2f} ms vs {step_before * 1e3:.2f} ms)" if lowered else
                f"did not lower the exposed time ({after * 1e3:.2f} ms vs {before * 1e3:.2f} ms; the group's "
                f"{group_after * 1e3:.2f} ms vs {group_before * 1e3:.2f} ms)")
        return self._move(key, state, state.rung - 1, f"{self.labels[state.rung]} {what}; not tried again for "
                          f"{state.cap_until - self.steps} steps")

    def _move(self, key: str, state: _Key, to: int, reason: str) -> Decision:
        decision = Decision(self.steps, key, self.labels[state.rung], self.labels[to], reason)
        state.rung, state.exposed_run, state.hidden_run, state.urgent_run, state.blind = to, 0, 0, 0, self.lag
        state.recent = []
        return decision

    def state_dict(self) -> dict[str, object]:
        """The rungs, run counters and guard (plain data) for a checkpoint."""
        return {"steps": self.steps, "ceiling": self.ceiling, "group": list(self._group),
                "keys": {k: asdict(s) for k, s in self._state.items()},
                "guard": [self._guard.ema, self._guard.lowest, self._guard.seen]}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore state_dict()."""
        keys = state["keys"]
        assert isinstance(keys, dict)
        if sorted(keys) != sorted(self.keys):
            raise ValueError(f"adaptive state is for keys {sorted(keys)}, this controller has {sorted(self.keys)}")
        self.steps, self.ceiling = int(state["steps"]), int(state["ceiling"])  # type: ignore[call-overload]
        self._state = {k: _Key(**{**v, "recent": list(v["recent"]),
                                  "watch": None if v["watch"] is None else [list(w) for w in v["watch"]]})
                       for k, v in keys.items()}
        self._group = [list(g) for g in state["group"]]  # type: ignore[attr-defined]
        guard = state["guard"]
        assert isinstance(guard, list)
        self._guard = _Guard(*guard)
