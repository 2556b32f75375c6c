"""Part: duplexpipe's runtime against torch.distributed.pipelining, training steps A/B interleaved."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import harness, models, runner
from benchmarks.framework import Block, Part, Result, bars, mark, ms
from benchmarks.models import TORCH_SCHEDULES, build_pipeline, build_torch_pipe, group_grads, num_stages
from duplexpipe.train.pipeline_config import SafetyConfig

GRAD_TOLERANCE = 1e-4  # the largest relative gradient error that matches the single-process reference
SIDES = ("ours", "torch")


@dataclass(frozen=True)
class Workload:
    """One A/B comparison: a model and the schedules to run it under."""

    name: str  # its label in the report ("overhead-bound", "compute-bound")
    spec: models.ModelSpec  # the model and batch
    target: float = 1.0  # ours / torch median step time, at most
    schedules: tuple[str, ...] = tuple(TORCH_SCHEDULES)  # schedule keys, each present in both frameworks
    num_microbatches: int = 8  # microbatches per step
    warmup: int = 2  # untimed steps per side first
    reps: int = 10  # timed steps per side; the sides alternate which goes first
    check_inputs_every_step: bool = True  # ours: SafetyConfig.check_inputs_every_step (True is the default)


@dataclass(frozen=True)
class VsTorchConfig:
    """The workloads and the ranks."""

    workloads: tuple[Workload, ...] = (
        Workload("overhead-bound", models.MLP, reps=30),
        Workload("compute-bound", models.TRANSFORMER, reps=12),
        Workload("overhead-bound, fixed shapes", models.MLP, 0.9, ("1f1b",), reps=30, check_inputs_every_step=False))
    world: int = 4  # pipeline ranks (gloo processes)


QUICK = VsTorchConfig((Workload("overhead-bound", models.ModelSpec("mlp", num_layers=4, width=16, batch=8),
                                schedules=("1f1b", "zbv"), num_microbatches=4, warmup=1, reps=2),), world=2)


def _schedule(key: str, w: Workload, rank: int, world: int, ref: list[list[torch.Tensor]]) -> dict[str, Any]:
    x, y = models.make_batch(w.spec)
    parts = models.build_parts(w.spec, num_stages(key, world))
    ours = build_pipeline(key, parts, w.num_microbatches,
                          safety=SafetyConfig(check_inputs_every_step=w.check_inputs_every_step))
    theirs = build_torch_pipe(key, parts, rank, world, w.num_microbatches)
    traces = harness.RoundRobin[Any]([ours, theirs], lambda pipe, _: pipe.step(x, y)).run(w.reps, w.warmup)
    errors = [max(models.max_rel_error(g, ref[k]) for k, g in group_grads(ours.stage_modules, ours.schedule).items()),
              max(models.max_rel_error(models.part_grads(m), ref[s]) for s, m in theirs.modules.items())]
    return {"samples": {"ours": traces[0].wall, "torch": traces[1].wall}, "cpu": {"ours": traces[0].cpu,
            "torch": traces[1].cpu}, "grad_error": {"ours": errors[0], "torch": errors[1]}}


def worker(rank: int, world: int, w: Workload) -> dict[str, Any]:
    """Every schedule of one workload on this rank."""
    x, y = models.make_batch(w.spec)
    refs = {n: models.reference_grads(models.build_parts(w.spec, n), x, y, w.num_microbatches)[0]
            for n in {num_stages(key, world) for key in w.schedules}}
    return {key: _schedule(key, w, rank, world, refs[num_stages(key, world)]) for key in w.schedules}


def summarize(w: Workload, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per schedule: medians, ours / torch, CPU summed over the ranks, the gradient checks."""
    rows = []
    for key, res in per_rank[0].items():
        ours, theirs = (harness.summarize(res["samples"][s]) for s in SIDES)
        errors = {s: max(r[key]["grad_error"][s] for r in per_rank) for s in SIDES}
        cpu = {s: 1e3 * statistics.median(map(sum, zip(*(r[key]["cpu"][s] for r in per_rank), strict=True)))
               for s in SIDES}
        rows.append({"workload": w.name, "model": w.spec.describe(), "schedule": key,
                     "torch_class": TORCH_SCHEDULES[key][0], "microbatches": w.num_microbatches, "target": w.target,
                     "ours": ours.to_dict(), "torch": theirs.to_dict(), "ratio": ours.median / theirs.median,
                     "cpu_ms": cpu, "grad_error": errors, "paired_ratio": harness.summarize([a / b for a, b in zip(
                         res["samples"]["ours"], res["samples"]["torch"], strict=True)]).to_dict(),
                     "grads_match": {s: e <= GRAD_TOLERANCE for s, e in errors.items()}, "samples": res["samples"]})
    return rows


def run(cfg: VsTorchConfig) -> Result:
    """Spawn the ranks once per workload; the rows."""
    return {"rows": [row for w in cfg.workloads for row in summarize(w, harness.spawn(worker, w, cfg.world, 600))],
            "world": cfg.world}


def report(result: Result) -> list[Block]:
    """One row per (workload, schedule)."""
    return [[["workload", "schedule", "ours ms (median)", "torch ms (median)", "ours IQR", "torch IQR", "ours/torch",
              "paired ratio (median, IQR)", "target", "met", "grads ours", "grads torch"]] + [
        [r["workload"], r["schedule"], ms(r["ours"]["median_s"]), ms(r["torch"]["median_s"]),
         *(f"{ms(r[s]['q1_s'])}-{ms(r[s]['q3_s'])}" for s in SIDES), f"{r['ratio']:.2f}",
         "{median_s:.2f} ({q1_s:.2f}-{q3_s:.2f})".format(**r["paired_ratio"]), f"<= {r['target']:g}",
         mark(r["ratio"] <= r["target"]),
         *("match" if r["grads_match"][s] else f"DIFF {r['grad_error'][s]:.1e}" for s in SIDES)]
        for r in result["rows"]]]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Ours / torch per schedule, a bar per workload."""
    rows = result["rows"]
    labels = list(dict.fromkeys(r["schedule"] for r in rows))
    series = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        by = {r["schedule"]: r for r in rows if r["workload"] == name}
        target = next(iter(by.values()))["target"]
        series[f"{name} (target <= {target:g})"] = [by[s]["ratio"] if s in by else math.nan for s in labels]
    bars(os.path.join(folder, "bench_ratios.png"), labels, series, 1.0, "parity", "median step time, ours / torch",
         "duplexpipe runtime vs torch.distributed.pipelining (lower is better)")
    return [("bench_ratios.png", "Median step time, ours / torch, against the targets")]


PART = Part("vs_torch", "Runtime vs torch.distributed.pipelining", VsTorchConfig(), QUICK, run, report, figures,
            block="vs-torch")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
