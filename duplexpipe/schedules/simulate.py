"""Event-driven simulation of a schedule under a cost model, producing a Timeline."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.execute import run_program
from duplexpipe.schedules.ir import Action, Op, Schedule
from duplexpipe.schedules.layout import Layout, gc_paused
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.moe_cost import ExpertCost
from duplexpipe.schedules.program import Durations, analyze
from duplexpipe.schedules.shard import gradient_deltas
from duplexpipe.schedules.timeline import Event, MemoryStep, Span, Timeline
from duplexpipe.schedules.verify import explain_stuck

_KEYS = {"f": "f", "b": "b", "w": "w", "fb": "fb", "f&b": "fb", "latency": "latency",
         "bandwidth": "bandwidth", "bytes": "activation_bytes", "activation_bytes": "activation_bytes",
         "stage_scale": "stage_scale", "moe_layers": "moe_layers", "dispatch": "dispatch", "combine": "combine",
         "fb_overlap": "fb_overlap", "param_bytes": "param_bytes", "dp": "dp", "dp_bandwidth": "dp_bandwidth",
         "hpz_ranks": "hpz_ranks", "hpz_bandwidth": "hpz_bandwidth"}
_FLAGS = ("stage_scale", "fb_overlap")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class CostModel:
    """How long each action takes; all times in one arbitrary unit (the Timeline's)."""

    f: float = 1.0
    """Forward of one stage for one microbatch."""
    b: float = 2.0
    """Full backward (input and weight gradient) of one stage for one microbatch."""
    w: float = 1.0
    """The weight-gradient part of `b` (a W action); an input-gradient I costs b - w."""
    fb: float | None = None
    """An OVERLAP_F_B pair with a full B part (F&B); None: f + b of its two parts. A pair
    whose backward part is an I costs fb - w."""
    stage_costs: Mapping[int, tuple[float, float, float]] = field(default_factory=dict)
    """Per-stage (f, b, w) overriding f, b and w for the stages named."""
    latency: float = 0.0
    """Fixed time of one message between ranks."""
    bandwidth: float = math.inf
    """Bytes per unit time between two ranks (inf: transfers take only `latency`)."""
    activation_bytes: float = 0.0
    """Size in bytes of one message (an activation or its gradient)."""
    stage_scale: bool = False
    """The cost convention. False: f/b/w/fb (and stage_costs) are the times of one stage, whatever
    share of the model it holds. True: they are the times of 1/P of the model (P = num_ranks, what
    one rank holds in 1F1B), and each stage's times are multiplied by num_ranks / num_groups (the
    schedule's model parts): 1 for GPipe, 1F1B, ZB-H1 and DualPipe, 1/2 for ZB-V, DualPipeV and
    interleaved 1F1B with 2 chunks. Schedules that cut one model into different numbers of parts
    then compare on equal work; the `duplexpipe` command uses True by default (`--costs-per`).
    Message times (latency, bandwidth) are never scaled."""
    moe_layers: int = 0
    """MoE layers with expert-parallel all-to-alls in every stage (0: none). Their exchanges are priced by
    `dispatch` and `combine` on top of f, b and I (never W), see `schedules.moe_cost`."""
    dispatch: float = 0.0
    """One MoE layer's dispatch all-to-all (forward; its backward sends as much back)."""
    combine: float = 0.0
    """One MoE layer's combine all-to-all (forward; its backward likewise)."""
    fb_overlap: bool = True
    """An F&B pair of MoE stages runs interleaved at its exchanges (each hidden behind the other part's
    compute as far as it goes); False: the forward, then the backward. Ignored when `fb` is given."""
    param_bytes: float = 0.0
    """Bytes of one stage's parameters, unsharded (its gradients take as many); scaled like f, b and w under
    `stage_scale`. Prices ZeRO-3's UNSHARD and REDUCE_GRAD and gives the memory curves (0: neither)."""
    dp: int = 1
    """Data-parallel replicas: a ZeRO-3 stage keeps param_bytes / dp at rest, and each all-gather or reduce-scatter
    moves (dp - 1) / dp of param_bytes per rank."""
    dp_bandwidth: float = math.inf
    """Bytes per unit time of one rank in a data-parallel collective (inf: they take no time)."""
    hpz_ranks: int = 0
    """hpZ (ZeroOptions.hpz_ranks; 0: none): a ZeRO-3 stage's all-gathers after its first of the step run inside a
    group of this many ranks, moving (hpz_ranks - 1) / hpz_ranks of param_bytes at `hpz_bandwidth`, and the stage
    keeps param_bytes / hpz_ranks between its episodes (param_bytes / dp after its last)."""
    hpz_bandwidth: float = math.inf
    """Bytes per unit time of one rank in a node-local (hpZ) all-gather (inf: they take no time)."""

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "latency", "activation_bytes", "dispatch", "combine", "param_bytes"):
            _check_time(name, getattr(self, name))
        if isinstance(self.moe_layers, bool) or not isinstance(self.moe_layers, int) or self.moe_layers < 0:
            raise ValueError(f"cost moe_layers must be an int >= 0, got {self.moe_layers!r}")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"cost dp must be an int >= 1 (data-parallel replicas), got {self.dp!r}")
        if not self.dp_bandwidth > 0 or math.isnan(self.dp_bandwidth):
            raise ValueError(f"cost dp_bandwidth must be > 0 (bytes per unit time), got {self.dp_bandwidth!r}")
        if self.hpz_ranks and (isinstance(self.hpz_ranks, bool) or not isinstance(self.hpz_ranks, int)
                               or self.hpz_ranks < 2 or self.dp % self.hpz_ranks or self.dp == self.hpz_ranks):
            raise ValueError(f"cost hpz_ranks must be 0 (no hpZ) or an int >= 2 that divides dp={self.dp} and is "
                             f"smaller, got {self.hpz_ranks!r}")
        if not self.hpz_bandwidth > 0 or math.isnan(self.hpz_bandwidth):
            raise ValueError(f"cost hpz_bandwidth must be > 0 (bytes per unit time), got {self.hpz_bandwidth!r}")
        if self.fb is not None:
            _check_time("fb", self.fb)
        if not self.bandwidth > 0 or math.isnan(self.bandwidth):
            raise ValueError(f"cost bandwidth must be > 0 (bytes per unit time), got {self.bandwidth!r}")
        if self.w > self.b:
            raise ValueError(f"cost w={self.w} exceeds b={self.b}: W is a part of the full backward B")
        table = {}
        for stage, costs in dict(self.stage_costs).items():
            if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
                raise ValueError(f"stage_costs needs stage numbers >= 0 as keys, got {stage!r}")
            if len(costs) != 3:
                raise ValueError(f"stage_costs[{stage}] must be (f, b, w), got {costs!r}")
            for name, value in zip("fbw", costs, strict=True):
                _check_time(f"stage_costs[{stage}].{name}", value)
            if costs[2] > costs[1]:
                raise ValueError(f"stage_costs[{stage}]: w={costs[2]} exceeds b={costs[1]}")
            table[stage] = (float(costs[0]), float(costs[1]), float(costs[2]))
        object.__setattr__(self, "stage_costs", MappingProxyType(table))

    def __hash__(self) -> int:
        values = tuple(getattr(self, f.name) for f in fields(self) if f.name != "stage_costs")
        return hash(values + tuple(sorted(self.stage_costs.items())))

    @property
    def comm_time(self) -> float:
        """The time one message takes: latency + activation_bytes / bandwidth."""
        return self.latency + (self.activation_bytes / self.bandwidth if self.activation_bytes else 0.0)

    @property
    def experts(self) -> ExpertCost:
        """The expert-parallel exchanges (`moe_layers`, `dispatch`, `combine`, `fb_overlap`)."""
        return ExpertCost(self.moe_layers, self.dispatch, self.combine, self.fb_overlap)

    def compute_times(self, schedule: Schedule) -> tuple[list[float], list[float], list[float]]:
        """Per-stage (f, b, w) of the compute alone (stage_costs and stage_scale applied, no exchanges)."""
        count = schedule.num_stages
        unknown = sorted(s for s in self.stage_costs if s >= count)
        if unknown:
            raise ValueError(f"stage_costs names stages {unknown}, but {schedule.name!r} has stages "
                             f"0..{count - 1}")
        scale = schedule.num_ranks / schedule.num_groups if self.stage_scale else 1.0
        table = [self.stage_costs.get(s, (self.f, self.b, self.w)) for s in range(count)]
        f, b, w = ([c[k] * scale for c in table] for k in range(3))
        return f, b, w

    def stage_param_bytes(self, schedule: Schedule) -> list[float]:
        """Per stage: its parameters' bytes, unsharded (`param_bytes`, scaled as f/b/w are under stage_scale)."""
        scale = schedule.num_ranks / schedule.num_groups if self.stage_scale else 1.0
        return [self.param_bytes * scale] * schedule.num_stages

    def collective_times(self, schedule: Schedule) -> list[float]:
        """Per stage: one all-gather (UNSHARD) or reduce-scatter (REDUCE_GRAD) of its parameters' bytes:
        (dp - 1) / dp of them at `dp_bandwidth`."""
        share = (self.dp - 1) / self.dp
        return [size * share / self.dp_bandwidth for size in self.stage_param_bytes(schedule)]

    def local_gather_times(self, schedule: Schedule) -> list[float] | None:
        """Per stage: one node-local (hpZ) all-gather of its parameters, (hpz_ranks - 1) / hpz_ranks of them at
        `hpz_bandwidth`; None without hpZ."""
        if not self.hpz_ranks:
            return None
        share = (self.hpz_ranks - 1) / self.hpz_ranks
        return [size * share / self.hpz_bandwidth for size in self.stage_param_bytes(schedule)]

    def durations(self, schedule: Schedule) -> Durations:
        """Per-stage action times for `schedule` (stage_costs and stage_scale applied; the MoE exchanges
        added to F, B and I, an F&B pair priced by the piece model unless `fb` is given, and ZeRO-3's
        collectives by `collective_times`)."""
        f, b, w = self.compute_times(schedule)
        ep = self.experts
        comm = ep.per_pass
        scale = schedule.num_ranks / schedule.num_groups if self.stage_scale else 1.0
        fb = None if self.fb is None else [self.fb * scale] * len(f)
        if fb is None and comm:
            fb = [ep.pair(ff, bb, ww) for ff, bb, ww in zip(f, b, w, strict=True)]
        gathers = self.collective_times(schedule)
        return Durations([x + comm for x in f], [x + comm for x in b],
                         [bb - ww + comm for bb, ww in zip(b, w, strict=True)], w, fb, gathers, gathers,
                         self.local_gather_times(schedule))

    @staticmethod
    def parse(text: str) -> CostModel:
        """Build from "F=1,B=2,W=1,FB=3,latency=0,bandwidth=1e9,bytes=4e6,stage_scale=true".

        Keys are case-insensitive (F&B is accepted for FB); unset keys keep their defaults.
        Raises ValueError naming the bad key or value.
        """
        values: dict[str, Any] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or not key:
                raise ValueError(f"bad cost item {item!r} in {text!r}: expected KEY=VALUE")
            name = _KEYS.get(key.lower())
            if name is None:
                raise ValueError(f"unknown cost key {key!r}; known keys: F, B, W, FB, latency, bandwidth, "
                                 "bytes, stage_scale, param_bytes, dp, dp_bandwidth, hpz_ranks, hpz_bandwidth")
            if name in values:
                raise ValueError(f"cost key {key!r} is given twice in {text!r}")
            values[name] = _parse_value(key, name, raw)
        return CostModel(**values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (stage_costs as {"stage": [f, b, w]})."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stage_costs"}
        out["stage_costs"] = {str(s): list(c) for s, c in self.stage_costs.items()}
        return out


def _check_time(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"cost {name} must be a finite number >= 0, got {value!r}")


def _parse_value(key: str, name: str, raw: str) -> Any:
    if name in ("moe_layers", "dp", "hpz_ranks"):
        if not raw.isdigit():
            raise ValueError(f"cost key {key!r} needs a whole number >= 0, got {raw!r}")
        return int(raw)
    if name in _FLAGS:
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"cost key {key!r} needs true or false, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"cost key {key!r} needs a number, got {raw!r}") from None
    if math.isnan(value):
        raise ValueError(f"cost key {key!r} needs a number, got {raw!r}")
    return value


def simulate(schedule: Schedule, cost: CostModel | None = None) -> Timeline:
    """Time `schedule` under `cost` (default CostModel()); a compute-only schedule is lowered first.

    Event-driven under docs/design.md's execution contract: each rank runs its list in order;
    RECV and SEND take no rank time; a transfer starts once both the SEND and the matching
    RECV are posted and takes `cost.comm_time` (no link contention); a compute starts when
    its rank is free and its inputs have arrived; an OVERLAP_F_B pair is one unit. The
    Timeline holds compute actions only. The schedule's structure is checked on the way
    (ScheduleError as from `verify`); a schedule that cannot finish raises ScheduleError
    showing where each rank is stuck.
    """
    cost = cost if cost is not None else CostModel()
    lowered = lower(schedule)
    layout = Layout.of(lowered)
    program = analyze(lowered, layout, cost.durations(lowered))
    with gc_paused():
        run = run_program(program, layout.num_tokens, cost.comm_time, record=True)
        if not run.finished:
            raise ScheduleError("simulation stuck: " + explain_stuck(lowered, layout, program, run).message)
        events = tuple(Event(rank, action, start, end)
                       for rank, row in enumerate(run.events) for action, start, end in row)
        spans = tuple(Span(rank, FSDP_LANE, str(action), start, end) for rank, row in enumerate(run.collectives)
                      for action, start, end in row if action.op is not Op.RESHARD)
    return Timeline(schedule.name, schedule.num_ranks, schedule.num_microbatches, events,
                    spans=_exchange_spans(events, lowered, cost) + spans,
                    memory=_memory(lowered, cost, run.events, run.collectives) if cost.param_bytes else ())


FSDP_LANE = "fsdp"
"""The lane of ZeRO-3's collectives in a simulated Timeline: each UNSHARD (all-gather) and REDUCE_GRAD
(reduce-scatter) from when it starts to when it completes."""


def _memory(schedule: Schedule, cost: CostModel, events: list[list[tuple[Action, float, float]]],
            collectives: list[list[tuple[Action, float, float]]]) -> tuple[MemoryStep, ...]:
    """Parameter and gradient bytes per rank over time.

    With UNSHARD/RESHARD a stage keeps 1/dp of its parameters at rest and all of them from its all-gather's start
    to its RESHARD (hpZ: 1/hpz_ranks from a RESHARD to the stage's next all-gather); without, all of them
    throughout. Gradients as `shard.gradient_deltas`: all of a stage's bytes from the start of its first B or W
    since its last REDUCE_GRAD to the end of the next, 1/dp after its first (a windowed pass reduces after each
    episode); without REDUCE_GRAD, all of them to the end.
    """
    size = cost.stage_param_bytes(schedule)
    sharded = schedule.has_fsdp and any(a.op is Op.UNSHARD for row in schedule.actions for a in row)
    out: list[MemoryStep] = []
    for rank in range(schedule.num_ranks):
        mine = schedule.stages_of_rank(rank)
        at_rest = sum(size[s] / cost.dp if sharded else size[s] for s in mine)
        computes, fsdp = iter(events[rank]), iter(collectives[rank])
        timed = [next(computes) if a.op.is_compute else next(fsdp) for a in schedule.actions[rank]
                 if a.op.is_compute or a.op.is_fsdp]
        deltas: list[tuple[float, int, float, float]] = [  # (time, order: frees first, params, grads)
            (time, int(dg > 0), 0.0, dg) for time, dg in gradient_deltas(timed, size, [b / cost.dp for b in size])]
        left = Counter(a.stage for a, _, _ in collectives[rank] if a.op is Op.RESHARD)
        kept = dict.fromkeys(mine, 0.0)  # stage -> bytes of its secondary (hpZ) shard held now
        for action, start, _ in collectives[rank]:
            stage = action.stage
            if action.op is Op.UNSHARD:
                deltas.append((start, 1, size[stage] - kept[stage], 0.0))
                kept[stage] = 0.0
            elif action.op is Op.RESHARD:
                left[stage] -= 1
                kept[stage] = size[stage] / cost.hpz_ranks if cost.hpz_ranks and left[stage] else 0.0
                deltas.append((start, 0, kept[stage] - size[stage], 0.0))
        params, grads = at_rest, 0.0
        out.append(MemoryStep(rank, 0.0, params, grads))
        for time, _, dp_, dg in sorted(deltas):
            params, grads = params + dp_, grads + dg
            out.append(MemoryStep(rank, time, params, grads))
    return tuple(out)


def _exchange_spans(events: tuple[Event, ...], schedule: Schedule, cost: CostModel) -> tuple[Span, ...]:
    """The MoE exchanges of every compute event on the "ep" lane (none without MoE layers)."""
    ep = cost.experts
    if not ep.per_pass:
        return ()
    f, b, w = cost.compute_times(schedule)
    spans: list[Span] = []
    for event in events:
        stage = event.action.stage
        back = event.action.parts[1] if event.action.op.name == "OVERLAP_F_B" else event.action
        partial = w[stage] if back.op.name == "I" else 0.0
        spans += ep.spans(event, f[stage], b[stage] - partial, w[stage] if back.op.name == "B" else 0.0)
    return tuple(spans)


def summary(timeline: Timeline) -> dict[str, Any]:
    """makespan, bubble_ratio and per_rank [{rank, busy, idle, peak_activations}] of `timeline`; with ZeRO-3
    collectives also step_time (from the first all-gather's start to the last collective's end) and per rank
    all_gathers, and with memory steps
    peak_param_bytes and peak_grad_bytes."""
    by_rank: list[list[Event]] = [[] for _ in range(timeline.num_ranks)]
    for event in timeline.events:
        by_rank[event.rank].append(event)
    span = timeline.makespan
    rows = []
    for rank, events in enumerate(by_rank):
        alone = Timeline(timeline.schedule_name, timeline.num_ranks, timeline.num_microbatches, tuple(events))
        busy = alone.busy(rank)
        rows.append({"rank": rank, "busy": busy, "idle": span - busy,
                     "peak_activations": alone.peak_activations(rank)})
        if timeline.memory:
            rows[-1]["peak_param_bytes"], rows[-1]["peak_grad_bytes"] = timeline.peak_memory(rank)
        gathers = [s for s in timeline.spans if s.lane == FSDP_LANE and s.rank == rank]
        if gathers:
            rows[-1]["all_gathers"] = sum(s.name.endswith("UNSHARD") for s in gathers)
    idle = sum(row["idle"] for row in rows)
    ratio = idle / (timeline.num_ranks * span) if span > 0 else 0.0
    out = {"makespan": span, "bubble_ratio": ratio, "per_rank": rows}
    lane = [s for s in timeline.spans if s.lane == FSDP_LANE]
    if lane:
        first = min(timeline.start, min(s.start for s in lane))
        out["step_time"] = max(timeline.start + span, max(s.end for s in lane)) - first
    return out
