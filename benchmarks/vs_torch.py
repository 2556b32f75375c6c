"""Part 1: duplexpipe's runtime against torch.distributed.pipelining, A/B interleaved per step."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness, models
from benchmarks.ours_side import build_pipeline, frozen_sgd
from benchmarks.torch_side import TORCH_SCHEDULES, build_torch_pipe, num_stages

GRAD_TOLERANCE = 1e-4
"""Largest relative gradient error accepted as a match with the single-process reference."""


@dataclass(frozen=True)
class VsTorchConfig:
    """One A/B comparison: a workload and the schedules to run it under."""

    name: str
    """Label of the workload in the report ("overhead-bound", "compute-bound")."""
    spec: models.ModelSpec
    """The model and batch."""
    schedules: tuple[str, ...] = tuple(TORCH_SCHEDULES)
    """Schedule keys, each present in both frameworks."""
    num_microbatches: int = 8
    """Microbatches per step."""
    warmup: int = 2
    """Untimed steps per side before timing."""
    reps: int = 10
    """Timed steps per side; the sides alternate which goes first."""
    check_inputs_every_step: bool = True
    """Ours: PipelineConfig.check_inputs_every_step (True is the default configuration)."""


def _sides(key: str, cfg: VsTorchConfig, rank: int, world: int) -> dict[str, Any]:
    parts = models.build_parts(cfg.spec, num_stages(TORCH_SCHEDULES[key][1], world))
    return {  # both sides train: zero_grad, the schedule, the optimizer step (SGD at lr 0)
        "ours": build_pipeline(key, parts, cfg.num_microbatches, models.loss_fn,
                               check_inputs_every_step=cfg.check_inputs_every_step),
        "torch": build_torch_pipe(key, parts, rank, world, cfg.num_microbatches, models.loss_fn, frozen_sgd),
    }


def _errors(side: str, pipe: Any, ref: list[list[torch.Tensor]]) -> float:
    if side == "ours":
        grads = pipe.group_grads()
        return max(models.max_rel_error(g, ref[k]) for k, g in grads.items())
    return max(models.max_rel_error(models.part_grads(m), ref[s]) for s, m in pipe.modules.items())


def _run_schedule(key: str, cfg: VsTorchConfig, rank: int, world: int,
                  batch: tuple[torch.Tensor, torch.Tensor], ref: list[list[torch.Tensor]]) -> dict[str, Any]:
    x, y = batch
    sides = _sides(key, cfg, rank, world)
    for _ in range(cfg.warmup):
        for pipe in sides.values():
            pipe.zero_grad()
            pipe.step(x, y)
    samples: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    errors: dict[str, float] = {}
    for rep in range(cfg.reps):
        order = ("ours", "torch") if rep % 2 == 0 else ("torch", "ours")
        for side in order:
            pipe = sides[side]
            pipe.zero_grad()
            elapsed, spent, _ = harness.timed_cpu(functools.partial(pipe.step, x, y))
            samples[side].append(elapsed)
            cpu[side].append(spent)
            if rep == cfg.reps - 1 or rep == cfg.reps - 2:
                errors[side] = _errors(side, pipe, ref)
    worst = torch.tensor([errors["ours"], errors["torch"]], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"samples": samples, "cpu": cpu, "grad_error": {"ours": float(worst[0]), "torch": float(worst[1])}}


def worker(rank: int, world: int, cfg: VsTorchConfig) -> dict[str, Any]:
    """Run every schedule of `cfg` on this rank; rank 0's result is the report."""
    batch = models.make_batch(cfg.spec)
    refs: dict[int, list[list[torch.Tensor]]] = {}
    out: dict[str, Any] = {}
    for key in cfg.schedules:
        n = num_stages(TORCH_SCHEDULES[key][1], world)
        if n not in refs:
            refs[n] = models.reference_grads(models.build_parts(cfg.spec, n), *batch, cfg.num_microbatches)[0]
        out[key] = _run_schedule(key, cfg, rank, world, batch, refs[n])
    return out


def summarize(cfg: VsTorchConfig, raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per schedule: medians, ratio ours/torch, gradient checks."""
    rows = []
    for key, res in raw.items():
        ours = harness.summarize(res["samples"]["ours"])
        theirs = harness.summarize(res["samples"]["torch"])
        paired = harness.summarize([a / b for a, b in zip(res["samples"]["ours"], res["samples"]["torch"],
                                                          strict=True)])
        rows.append({
            "workload": cfg.name,
            "model": cfg.spec.describe(),
            "schedule": key,
            "torch_class": TORCH_SCHEDULES[key][0],
            "microbatches": cfg.num_microbatches,
            "ours": ours.to_dict(),
            "torch": theirs.to_dict(),
            "ratio": ours.median / theirs.median,
            "cpu_ms": {side: 1e3 * harness.summarize(v).median for side, v in res.get("cpu", {}).items()},
            "paired_ratio": paired.to_dict(),
            "grad_error": res["grad_error"],
            "grads_match": {side: err <= GRAD_TOLERANCE for side, err in res["grad_error"].items()},
            "samples": res["samples"],
        })
    return rows


def run(cfg: VsTorchConfig, world: int = 4, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Spawn `world` gloo ranks, run the comparison, return the summary rows."""
    return summarize(cfg, harness.spawn(worker, cfg, world, timeout_s)[0])
