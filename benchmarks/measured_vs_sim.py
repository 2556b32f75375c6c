"""Part 2: measured step time and bubble of a sleep model against the simulator with the same costs."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks import harness, models
from benchmarks.ours_side import build_ours, runtime_config
from duplexpipe.runtime import gather_timeline
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.schedules.registry import build, names
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.timeline import Event, Timeline


@dataclass(frozen=True)
class SimConfig:
    """The synthetic-model run: costs, shape, schedules."""

    f_ms: float = 20.0
    """Forward sleep per stage and microbatch."""
    i_ms: float = 20.0
    """Input-gradient backward sleep."""
    w_ms: float = 20.0
    """Weight-gradient backward sleep."""
    num_microbatches: int = 16
    """Microbatches per step."""
    width: int = 64
    """Features per sample (activations stay small: this run is about compute placement)."""
    samples_per_microbatch: int = 2
    """Batch rows per microbatch."""
    schedules: tuple[str, ...] = ()
    """Registry names to run; empty means every registered schedule."""
    warmup: int = 1
    """Untimed steps per schedule."""
    reps: int = 3
    """Timed steps per schedule."""

    def spec(self) -> models.ModelSpec:
        """The sleep model for this run."""
        return models.ModelSpec("sleep", width=self.width,
                                batch=self.num_microbatches * self.samples_per_microbatch,
                                sleep_ms=(self.f_ms, self.i_ms, self.w_ms))

    def cost(self) -> CostModel:
        """The same costs in seconds for the simulator (a pair F&B runs its parts back to back)."""
        f, i, w = self.f_ms / 1e3, self.i_ms / 1e3, self.w_ms / 1e3
        return CostModel(f=f, b=i + w, w=w, fb=f + i + w)

    def schedule_names(self) -> tuple[str, ...]:
        """The schedules this run covers."""
        return self.schedules or names()


def calibrate(cfg: SimConfig, repeats: int = 5) -> dict[str, float]:
    """Seconds one sleep-model stage really takes for F, B, I and W here, with plain autograd (no runtime).

    Sleep overshoot and autograd overhead make these a little above the nominal sleeps.
    """
    import time

    import torch

    part = models.build_parts(cfg.spec(), 1)[0]
    bias = next(part.parameters())
    x = torch.randn(cfg.samples_per_microbatch, cfg.width, requires_grad=True)
    samples: dict[str, list[float]] = {"f": [], "b": [], "i": [], "w": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        y = part(x)
        t1 = time.perf_counter()
        torch.autograd.grad(y, [x], torch.ones_like(y), retain_graph=True)
        t2 = time.perf_counter()
        torch.autograd.grad(y, [bias], torch.ones_like(y))
        t3 = time.perf_counter()
        y = part(x)
        t4 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t5 = time.perf_counter()
        for key, value in zip("fiwb", (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
            samples[key].append(value)
    return {k: statistics.median(v[1:]) for k, v in samples.items()}


def calibrated_cost(costs: dict[str, float]) -> CostModel:
    """The simulator's cost model from calibrated seconds (F&B = F + B, as the runtime runs a pair)."""
    w = min(costs["w"], costs["b"])
    return CostModel(f=costs["f"], b=costs["b"], w=w, fb=costs["f"] + costs["b"])


def worker(rank: int, world: int, cfg: SimConfig) -> dict[str, Any]:
    """Time every schedule on the sleep model; rank 0 returns step times and the gathered timeline."""
    spec = cfg.spec()
    x, y = models.make_batch(spec)
    out: dict[str, Any] = {}
    for name in cfg.schedule_names():
        sched = build(name, world, cfg.num_microbatches)
        parts = models.build_parts(spec, sched.num_groups)
        pipe = build_ours(name, parts, rank, world, cfg.num_microbatches, models.loss_fn,
                          config=runtime_config(record_timeline=True, check_inputs_every_step=False), schedule=sched)
        for _ in range(cfg.warmup):
            pipe.zero_grad()
            pipe.step(x, y)
        samples, timelines = [], []
        for _ in range(cfg.reps):
            pipe.zero_grad()
            elapsed, result = harness.timed(functools.partial(pipe.step, x, y))
            samples.append(elapsed)
            timelines.append(gather_timeline(result.timeline))
        median_at = samples.index(sorted(samples)[(len(samples) - 1) // 2])
        out[name] = {"samples": samples, "timeline": timelines[median_at].to_dict(),
                     "timeline_makespans": [t.makespan for t in timelines]}
    return out


def handoff_gaps(timeline: Timeline, schedule: Schedule) -> list[float]:
    """Seconds from a producer's end to its consumer's start on another rank, where the consumer's rank
    sat idle in between (so the gap is transfer plus wake-up latency, not queueing behind other work)."""
    produced: dict[tuple[str, int, int], Event] = {}
    for e in timeline.events:
        for part in e.action.compute_parts():
            kind = "F" if part.op is Op.F else "B" if part.op in (Op.B, Op.I) else ""
            if kind:
                produced[(kind, part.stage, part.microbatch)] = e
    gaps = []
    for rank in range(timeline.num_ranks):
        idle_since = 0.0
        for e in timeline.rank_events(rank):
            ready = None  # the latest end of a producer on another rank (a pair waits for both inputs)
            for part in e.action.compute_parts():
                if part.op is Op.F:
                    src = schedule.prev_stage(part.stage)
                    prod = produced.get(("F", src, part.microbatch)) if src is not None else None
                elif part.op in (Op.B, Op.I):
                    src = schedule.next_stage(part.stage)
                    prod = produced.get(("B", src, part.microbatch)) if src is not None else None
                else:
                    prod = None
                if prod is not None and prod.rank != rank:
                    ready = prod.end if ready is None else max(ready, prod.end)
            if ready is not None and ready >= idle_since:
                gaps.append(e.start - ready)
            idle_since = max(idle_since, e.end)
    return gaps


def summarize(cfg: SimConfig, raw: dict[str, Any], world: int,
              costs: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One row per schedule: measured vs simulated makespan (nominal and calibrated costs) and bubble."""
    rows = []
    for name, res in raw.items():
        sim = simulate(build(name, world, cfg.num_microbatches), cfg.cost())
        sim_cal = simulate(build(name, world, cfg.num_microbatches), calibrated_cost(costs)) if costs else sim
        measured = Timeline.from_dict(res["timeline"])
        step = harness.summarize(res["samples"])
        gaps = sorted(handoff_gaps(measured, build(name, world, cfg.num_microbatches)))
        rows.append({
            "schedule": name,
            "ranks": world,
            "microbatches": cfg.num_microbatches,
            "costs_ms": {"f": cfg.f_ms, "i": cfg.i_ms, "w": cfg.w_ms},
            "step": step.to_dict(),
            "timeline_makespan_s": statistics.median(res["timeline_makespans"]),
            "simulated_makespan_s": sim.makespan,
            "ratio": step.median / sim.makespan,
            "timeline_ratio": statistics.median(res["timeline_makespans"]) / sim.makespan,
            "calibrated_costs_ms": {k: v * 1e3 for k, v in (costs or {}).items()},
            "simulated_calibrated_s": sim_cal.makespan,
            "ratio_calibrated": step.median / sim_cal.makespan,
            "bubble_measured": measured.bubble_ratio,
            "bubble_simulated": sim.bubble_ratio,
            "handoff_gap_ms": {"median": statistics.median(gaps) * 1e3 if gaps else None,
                               "p90": gaps[int(0.9 * (len(gaps) - 1))] * 1e3 if gaps else None,
                               "count": len(gaps)},
            "measured_timeline": res["timeline"],
            "simulated_timeline": sim.to_dict(),
        })
    return rows


def run(cfg: SimConfig, world: int = 4, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Calibrate the stage costs, spawn `world` gloo ranks, run every schedule, return the summary rows."""
    costs = calibrate(cfg)
    return summarize(cfg, harness.spawn(worker, cfg, world, timeout_s)[0], world, costs)
