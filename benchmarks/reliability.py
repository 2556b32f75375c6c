"""Part: what the reliability checks cost on the GPT example: the non-finite gradient check of every step, the first
step's batch fingerprint, and a checkpoint's manifest (SHA-256 of every file) against the whole save."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.framework import Block, Part, Result
from benchmarks.internals import batch_fingerprint, digest
from benchmarks.runner import main
from duplexpipe import Pipeline, PipelineConfig


@dataclass(frozen=True)
class ReliabilityConfig:
    """The GPT example (fp32, no clipping: the case where the non-finite check adds a collective of its own) on
    `ranks` pipeline ranks; two identical pipelines in the same processes stepped in turn, one with the check, one
    without (its norm-and-overflow all-reduce skipped, as before the check existed); then saves of the first."""

    ranks: int = 4  # pipeline ranks (processes)
    schedule: str = "1f1b"  # the schedule both pipelines run
    microbatches: int = 8  # microbatches per step
    batch_size: int = 32  # sequences per step
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})
    """gpt_task options (the example's model)."""
    steps: int = 60  # timed steps of each pipeline (after `warmup`)
    warmup: int = 5  # untimed steps of each first
    saves: int = 3  # checkpoints saved (timed whole, and their manifest's hashing alone)

    def __post_init__(self) -> None:
        if min(self.ranks, self.steps, self.saves) < 1 or self.warmup < 0:
            raise ValueError(f"ranks, steps and saves must be >= 1 and warmup >= 0, got {self.ranks}, {self.steps}, "
                             f"{self.saves}, {self.warmup}")


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """fn() between barriers: (the slowest rank's seconds, this rank's CPU seconds)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return float(wall.item()), cpu


def _no_check(need: bool) -> tuple[float | None, bool]:
    """The strategy's norm and overflow as they were without clipping or fp16: not computed, no collective."""
    return None, False


def _saves(pipe: Pipeline, cfg: ReliabilityConfig) -> dict[str, list[float]]:
    """Seconds of each whole save (slowest rank) and of hashing every file of it on one rank, as the manifest does
    (each rank hashes its own files in a save: the largest share is at most this)."""
    root = [tempfile.mkdtemp(prefix="duplexpipe-bench-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    out: dict[str, list[float]] = {"save_s": [], "hash_all_s": [], "bytes": []}
    for i in range(cfg.saves):
        path = Path(root[0]) / f"step-{i}"
        wall, _ = _timed(lambda: pipe.save(str(path)))  # noqa: B023 - called at once
        out["save_s"].append(wall)
        files = [p for p in path.iterdir() if p.name != "manifest.json"]
        start = time.perf_counter()
        for file in files:
            digest(file)
        out["hash_all_s"].append(time.perf_counter() - start)
        out["bytes"].append(float(sum(p.stat().st_size for p in files)))
    dist.barrier()
    return out


def _worker(rank: int, world: int, cfg: ReliabilityConfig) -> dict[str, Any]:
    task = harness.gpt(**cfg.task_options)
    config = PipelineConfig(cfg.schedule, cfg.microbatches)
    checked, unchecked = (harness.gpt_pipeline(task, config) for _ in range(2))
    unchecked.dp.norm_and_overflow = _no_check  # type: ignore[method-assign]
    traces = harness.RoundRobin([checked, unchecked], harness.gpt_step(task, cfg.batch_size)).run(cfg.steps,
                                                                                                 cfg.warmup)
    alone = [_timed(lambda: checked.dp.norm_and_overflow(True)) for _ in range(cfg.steps)]
    x, y = task.batch(0, cfg.batch_size)
    start = time.perf_counter()
    for _ in range(20):
        batch_fingerprint(x, y)
    fingerprint_s = (time.perf_counter() - start) / 20
    saves = _saves(checked, cfg)
    return {"wall": [t.wall for t in traces], "cpu": [t.cpu for t in traces], "fingerprint_s": fingerprint_s,
            "check_wall": [w for w, _ in alone], "check_cpu": [c for _, c in alone],
            "losses_equal": traces[0].out == traces[1].out, **saves}


def run(cfg: ReliabilityConfig) -> Result:
    """Both pipelines' step times per rank, the fingerprint's and the saves' seconds."""
    per_rank = harness.spawn(_worker, cfg, cfg.ranks, timeout_s=1800)
    return {"config": asdict(cfg), "machine": harness.machine_info(), "ranks": per_rank}


def summary(result: Result) -> dict[str, float]:
    """Median step ms with and without the check (slowest rank per step), the difference with its quartile spread,
    the median CPU ms per step on rank 0, the check timed alone (wall on the slowest rank, CPU over all ranks), the
    fingerprint in microseconds, the save and the hashing in ms."""
    ranks = result["ranks"]
    with_s, without_s = (ranks[0]["wall"][k] for k in (0, 1))
    diffs = [a - b for a, b in zip(with_s, without_s, strict=True)]
    q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else (min(diffs), 0.0, max(diffs))
    cpu_with, cpu_without = (statistics.median(ranks[0]["cpu"][k]) for k in (0, 1))
    return {"with_ms": statistics.median(with_s) * 1e3, "without_ms": statistics.median(without_s) * 1e3,
            "diff_ms": statistics.median(diffs) * 1e3, "diff_q1_ms": q1 * 1e3, "diff_q3_ms": q3 * 1e3,
            "cpu_with_ms": cpu_with * 1e3, "cpu_without_ms": cpu_without * 1e3,
            "fingerprint_us": statistics.median(r["fingerprint_s"] for r in ranks) * 1e6,
            "check_wall_ms": statistics.median(ranks[0]["check_wall"]) * 1e3,
            "check_cpu_ms": statistics.median(c for r in ranks for c in r["check_cpu"]) * 1e3,
            "save_ms": statistics.median(ranks[0]["save_s"]) * 1e3,
            "hash_ms": statistics.median(ranks[0]["hash_all_s"]) * 1e3,
            "checkpoint_mb": statistics.median(ranks[0]["bytes"]) / 1e6,
            "same_losses": float(all(r["losses_equal"] for r in ranks))}


def report(result: Result) -> list[Block]:
    """The step times with and without the check, the fingerprint, and the saves."""
    cfg, s = result["config"], summary(result)
    table = [["", "step ms (median, slowest rank)", "CPU ms per step (rank 0)"],
             ["with the non-finite check", f"{s['with_ms']:.2f}", f"{s['cpu_with_ms']:.2f}"],
             ["without (no norm all-reduce)", f"{s['without_ms']:.2f}", f"{s['cpu_without_ms']:.2f}"],
             ["difference of paired steps (median; quartiles)",
              f"{s['diff_ms']:+.2f} ({s['diff_q1_ms']:+.2f} to {s['diff_q3_ms']:+.2f})", ""],
             ["the check alone (norm, flag, all-reduce; between barriers)", f"{s['check_wall_ms']:.3f}",
              f"{s['check_cpu_ms']:.3f} (median over ranks)"]]
    wall_share = s["check_wall_ms"] / s["without_ms"] * 100 if s["without_ms"] else 0.0
    cpu_share = s["check_cpu_ms"] / s["cpu_without_ms"] * 100 if s["cpu_without_ms"] else 0.0
    saves = [["checkpoint", "save ms (slowest rank)", "SHA-256 of all its files on one rank, ms"],
             [f"{s['checkpoint_mb']:.1f} MB", f"{s['save_ms']:.0f}", f"{s['hash_ms']:.1f}"]]
    same = "the same losses" if s["same_losses"] else "**different losses**"
    return [f"The GPT example ({cfg['task_options']}, batch {cfg['batch_size']}, {cfg['microbatches']} microbatches, "
            f"{cfg['schedule']} on {cfg['ranks']} ranks, fp32, no clipping): two identical pipelines in the same "
            f"processes, stepped in turn for {cfg['steps']} steps after {cfg['warmup']}, one checking every step's "
            "gradients for NaN/inf (the norm and a flag in one all-reduce over the job), one not; they trained "
            f"{same}.", table,
            f"The check alone is {wall_share:.1f}% of a step's wall time and {cpu_share:.1f}% of its CPU time; "
            + ("zero lies between the paired differences' quartiles: the pipelines' difference is not measurable "
               "against the step-to-step noise." if s["diff_q1_ms"] <= 0 <= s["diff_q3_ms"] else
               "the paired differences' quartiles exclude zero: the difference is measurable."),
            f"The first step's batch fingerprint (BLAKE2b of the batch, then one all-gather of 8 bytes): "
            f"{s['fingerprint_us']:.0f} us of hashing per rank, once per run.", saves]


PART = Part("reliability", "Cost of the reliability checks", ReliabilityConfig(),
            ReliabilityConfig(ranks=2, steps=4, warmup=1, saves=1, microbatches=4, batch_size=8), run, report)

if __name__ == "__main__":
    raise SystemExit(main(only=PART.name))
