"""Part: measured step time and bubble of a sleep model against the simulator with the same costs."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import harness, models, runner
from benchmarks.framework import Block, Part, Result, bars, mark, ms
from benchmarks.internals import gather_timeline
from benchmarks.models import build_ours
from duplexpipe import CostModel, Op, Schedule, Timeline, build_schedule, schedule_names, simulate

TARGET = 1.05  # measured step over simulated makespan, at most


@dataclass(frozen=True)
class SimConfig:
    """The synthetic-model run: costs, shape, schedules."""

    f_ms: float = 20.0  # forward sleep per stage and microbatch
    i_ms: float = 20.0  # input-gradient backward sleep
    w_ms: float = 20.0  # weight-gradient backward sleep
    num_microbatches: int = 16  # microbatches per step
    width: int = 64  # features per sample (activations stay small: this run is about compute placement)
    samples_per_microbatch: int = 2  # batch rows per microbatch
    schedules: tuple[str, ...] = ()  # registry names to run; empty means every registered schedule
    warmup: int = 1  # untimed steps per schedule
    reps: int = 3  # timed steps per schedule
    world: int = 4  # pipeline ranks (gloo processes)

    def spec(self) -> models.ModelSpec:
        """The sleep model for this run."""
        return models.ModelSpec("sleep", width=self.width, batch=self.num_microbatches * self.samples_per_microbatch,
                                sleep_ms=(self.f_ms, self.i_ms, self.w_ms))

    def cost(self) -> CostModel:
        """The same costs in seconds for the simulator (a pair F&B runs its parts back to back)."""
        return calibrated_cost({"f": self.f_ms / 1e3, "b": (self.i_ms + self.w_ms) / 1e3, "w": self.w_ms / 1e3})

    def schedule(self, name: str) -> Schedule:
        """Schedule `name` on this run's ranks and microbatches."""
        return build_schedule(name, self.world, self.num_microbatches)


def calibrated_cost(costs: dict[str, float]) -> CostModel:
    """The simulator's cost model from seconds of F, B and W (F&B = F + B, as the runtime runs a pair)."""
    return CostModel(f=costs["f"], b=costs["b"], w=min(costs["w"], costs["b"]), fb=costs["f"] + costs["b"])


QUICK = SimConfig(f_ms=2.0, i_ms=2.0, w_ms=2.0, num_microbatches=4, width=8, schedules=("1f1b", "dualpipe"),
                  warmup=1, reps=2, world=2)


def calibrate(cfg: SimConfig, repeats: int = 5) -> dict[str, float]:
    """Seconds one sleep-model stage really takes for F, B, I and W here, with plain autograd (no runtime)."""
    part = models.build_parts(cfg.spec(), 1)[0]
    bias = next(part.parameters())
    x = torch.randn(cfg.samples_per_microbatch, cfg.width, requires_grad=True)
    runs = []
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
        runs.append((t1 - t0, t5 - t4, t2 - t1, t3 - t2))
    return {k: statistics.median(v[1:]) for k, v in zip("fbiw", zip(*runs, strict=True), strict=True)}


def worker(rank: int, world: int, cfg: SimConfig) -> dict[str, Any]:
    """Time every schedule on the sleep model; each step's time and gathered timeline."""
    x, y = models.make_batch(cfg.spec())
    out: dict[str, Any] = {}
    for name in cfg.schedules or schedule_names():
        sched = cfg.schedule(name)
        pipe = build_ours(name, models.build_parts(cfg.spec(), sched.num_groups), rank, world, cfg.num_microbatches,
                          sched, record_timeline=True, check_inputs_every_step=False)
        (trace,) = harness.RoundRobin([pipe], lambda p, _: p.step(x, y),
                                      lambda p: gather_timeline(p.last.timeline)).run(cfg.reps, cfg.warmup)
        median_at = trace.wall.index(sorted(trace.wall)[(len(trace.wall) - 1) // 2])
        out[name] = {"samples": trace.wall, "timeline": trace.extra[median_at].to_dict(),
                     "timeline_makespans": [t.makespan for t in trace.extra]}
    return out


def handoff_gaps(timeline: Timeline, schedule: Schedule) -> list[float]:
    """Seconds from a producer's end to its consumer's start on another rank that sat idle in between."""
    produced: dict[tuple[str, int, int], Any] = {}
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
                src, kind = ((schedule.prev_stage(part.stage), "F") if part.op is Op.F else
                             (schedule.next_stage(part.stage), "B") if part.op in (Op.B, Op.I) else (None, ""))
                prod = produced.get((kind, src, part.microbatch)) if src is not None else None
                if prod is not None and prod.rank != rank:
                    ready = prod.end if ready is None else max(ready, prod.end)
            if ready is not None and ready >= idle_since:
                gaps.append(e.start - ready)
            idle_since = max(idle_since, e.end)
    return gaps


def action_overheads(timeline: Timeline, schedule: Schedule, costs: dict[str, float]) -> tuple[float, float]:
    """(mean seconds a compute action ran beyond its calibrated cost, median seconds between one action's end and
    the next one's start on a rank): what the runtime adds inside an action and between two. A first stage's input
    takes no gradient, so its I sleeps nothing and its B only W's part."""
    per_op = {Op.F: costs["f"], Op.B: costs["b"], Op.I: costs["i"], Op.W: costs["w"]}
    first = {Op.F: costs["f"], Op.B: costs["w"], Op.I: 0.0, Op.W: costs["w"]}

    def cost(part: Any) -> float:
        return (first if schedule.prev_stage(part.stage) is None else per_op)[part.op]

    over, gaps = [], []
    for rank in range(timeline.num_ranks):
        events = timeline.rank_events(rank)
        for e in events:
            parts = e.action.compute_parts()
            if parts and all(p.op in per_op for p in parts):
                over.append(e.end - e.start - sum(cost(p) for p in parts))
        gaps += [b.start - a.end for a, b in zip(events, events[1:], strict=False)]
    return (statistics.fmean(over) if over else 0.0), (statistics.median(gaps) if gaps else 0.0)


def _row(cfg: SimConfig, name: str, res: dict[str, Any], costs: dict[str, float]) -> dict[str, Any]:
    sim, sim_cal = (simulate(cfg.schedule(name), cost) for cost in (cfg.cost(), calibrated_cost(costs)))
    measured, step = Timeline.from_dict(res["timeline"]), harness.summarize(res["samples"])
    gaps, makespan = sorted(handoff_gaps(measured, cfg.schedule(name))), statistics.median(res["timeline_makespans"])
    inside, between = action_overheads(measured, cfg.schedule(name), costs)
    return {"schedule": name, "ranks": cfg.world, "microbatches": cfg.num_microbatches,
            "costs_ms": {"f": cfg.f_ms, "i": cfg.i_ms, "w": cfg.w_ms}, "step": step.to_dict(),
            "timeline_makespan_s": makespan, "simulated_makespan_s": sim.makespan, "ratio": step.median / sim.makespan,
            "timeline_ratio": makespan / sim.makespan, "calibrated_costs_ms": {k: v * 1e3 for k, v in costs.items()},
            "simulated_calibrated_s": sim_cal.makespan, "ratio_calibrated": step.median / sim_cal.makespan,
            "bubble_measured": measured.bubble_ratio, "bubble_simulated": sim.bubble_ratio,
            "action_overrun_ms": inside * 1e3, "between_actions_ms": between * 1e3,
            "handoff_gap_ms": {"median": statistics.median(gaps) * 1e3 if gaps else None,
                               "p90": gaps[int(0.9 * (len(gaps) - 1))] * 1e3 if gaps else None, "count": len(gaps)},
            "measured_timeline": res["timeline"], "simulated_timeline": sim.to_dict()}


def run(cfg: SimConfig) -> Result:
    """Calibrate the stage costs, run every schedule on the ranks; one row per schedule."""
    costs = calibrate(cfg)
    raw = harness.spawn(worker, cfg, cfg.world, 600)[0]
    return {"rows": [_row(cfg, name, res, costs) for name, res in raw.items()]}


def report(result: Result) -> list[Block]:
    """One row per schedule."""
    return [[["schedule", "measured step ms", "trace makespan ms", "simulated ms", "measured/simulated", "met",
              "simulated, calibrated costs ms", "measured/calibrated", "bubble measured", "bubble simulated",
              "handoff gap ms (median / p90)", "runtime in an action ms (mean)", "between actions ms (median)"]] + [
        [r["schedule"], ms(r["step"]["median_s"]), ms(r["timeline_makespan_s"]), ms(r["simulated_makespan_s"]),
         f"{r['ratio']:.3f}", mark(r["ratio"] <= TARGET), ms(r["simulated_calibrated_s"]),
         f"{r['ratio_calibrated']:.3f}", f"{r['bubble_measured']:.1%}", f"{r['bubble_simulated']:.1%}",
         "-" if r["handoff_gap_ms"]["median"] is None else "{median:.2f} / {p90:.2f}".format(**r["handoff_gap_ms"]),
         f"{r.get('action_overrun_ms', float('nan')):.2f}", f"{r.get('between_actions_ms', float('nan')):.2f}"]
        for r in result["rows"]]]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Measured / simulated per schedule, and the Gantt of one measured step above its simulation."""
    rows = result["rows"]
    bars(os.path.join(folder, "bench_sim_ratio.png"), [r["schedule"] for r in rows],
         {"step time / simulated makespan": [r["ratio"] for r in rows]}, TARGET, f"target {TARGET:g}",
         "measured / simulated", "Sleep model: measured step time over simulated makespan (same costs)")
    row = next((r for r in rows if r["schedule"] == "dualpipe"), rows[0])
    measured, sim = (Timeline.from_dict(row[k]) for k in ("measured_timeline", "simulated_timeline"))
    name, c = row["schedule"], row["costs_ms"]
    shown = [Timeline(title, t.num_ranks, t.num_microbatches, t.events, kind, "s") for t, kind, title in (
        (measured, "measured", f"{name} measured (duplexpipe runtime, {measured.num_ranks} gloo ranks)"),
        (sim, "simulated", f"{name} simulated (F/I/W = {c['f']:g}/{c['i']:g}/{c['w']:g} ms)"))]
    from duplexpipe.viz import plot_comparison

    plot_comparison(shown, os.path.join(folder, "bench_measured_vs_sim.png"),
                    title=f"{name}: measured step vs simulated makespan, same costs, {measured.num_ranks} ranks, "
                          f"{measured.num_microbatches} microbatches")
    return [("bench_sim_ratio.png", "Measured step time over simulated makespan"),
            ("bench_measured_vs_sim.png", f"Measured vs simulated {row['schedule']} on the sleep model")]


PART = Part("measured_vs_sim", "Measured vs simulated (sleep model)", SimConfig(), QUICK, run, report, figures,
            block="measured-vs-sim")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
