"""Part: gradient compression in training, the GPT example at PP=2 x DP=2 (1F1B) per method against fp32."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks import harness, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result, figure
from duplexpipe import PipelineConfig, Timeline
from duplexpipe.train.pipeline_config import DataParallelConfig, SafetyConfig


@dataclass(frozen=True)
class Method:
    """One training run."""

    label: str  # row name
    compression: str | deep.Options | None  # DataParallelConfig.grad_compression
    optimizer: str  # "adamw" (the example's) or "sgd" (SGD, momentum 0.9) or "sgd0" (SGD without momentum, for DGC)
    fewer_bytes: float | None = None  # target: at least this many times fewer bytes than fp32 (steady state)
    loss_within: float | None = None  # target: mean loss of the last steps within this fraction of fp32's
    global_clip: bool = True  # clip the reduced gradient's global norm (DGC clips locally instead, before its momentum)


def _methods(warmup: int) -> tuple[Method, ...]:
    dgc = {"momentum": 0.9, "clip_norm": 1.0, "warmup_steps": warmup}
    return (
        Method("fp32 all-reduce", None, "adamw"),
        Method("bf16 (torch hook)", "bf16", "adamw", 1.95, 0.01), Method("fp16 (torch hook)", "fp16", "adamw"),
        Method("int8 blocks of 256, SR + EF", deep.Int8Options(), "adamw", 3.8, 0.01),
        Method("PowerSGD rank 4", deep.PowerSGDOptions(rank=4), "adamw", 6.0, 0.04),
        Method("fp32 all-reduce", None, "sgd"),
        Method("DGC 99%", deep.DGCOptions(ratio=0.01, **dgc), "sgd0", 45.0, 0.015, False),  # type: ignore[arg-type]
        Method("DGC 99.9%", deep.DGCOptions(ratio=0.001, **dgc), "sgd0", 400.0, 0.05, False),  # type: ignore[arg-type]
        Method("top-k 1% + EF", deep.TopKOptions(ratio=0.01), "sgd"),
        Method("random-k 1% + EF", deep.RandomKOptions(ratio=0.01), "sgd"),
        Method("threshold 0.5 max, 1% slots + EF", deep.ThresholdOptions(ratio=0.01, theta=0.5), "sgd"),
    )


@dataclass(frozen=True)
class DPBenchConfig:
    """The GPT example on PP x DP processes; per method its wire bytes, loss, step time and reduction compute."""

    steps: int = 200  # training steps per method
    tail: int = 20  # last steps whose loss (and bytes: the steady state) are averaged
    pp: int = 2  # pipeline ranks
    dp: int = 2  # data-parallel replicas
    schedule: str = "1f1b"  # schedule
    microbatches: int = 4  # microbatches per step and replica
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})  # gpt_task options
    batch_size: int = 32  # sequences per step over all replicas (the example's global batch)
    adamw_lr: float = 3e-3  # the example's AdamW learning rate (weight decay 0.01)
    sgd_lr: float = 0.1  # SGD learning rate (momentum 0.9; DGC: its compressor's momentum 0.9, SGD without momentum)
    clip: float = 1.0  # global gradient-norm clip; DGC clips each replica's mean gradient to clip * sqrt(DP) instead
    dgc_warmup_steps: int = 10  # DGC: steps at each warm-up sparsity (75%, 93.75%, 98.4375%, 99.6%) below its target
    methods: tuple[str, ...] = ()  # labels (with optimizer, "label|opt") to run; empty: all
    lane_steps: int = 6  # steps of the run whose last timeline shows the data-parallel lane (0: no such run)

    def __post_init__(self) -> None:
        if self.steps < self.tail + 5:
            raise ValueError(f"steps must be >= tail + 5 = {self.tail + 5} (the first 5 are not timed), got "
                             f"{self.steps}")


QUICK = DPBenchConfig(steps=8, tail=3, methods=("fp32 all-reduce|adamw", "int8 blocks of 256, SR + EF"), lane_steps=2)


def _optimizer(name: str, cfg: DPBenchConfig) -> harness.Optimizer:
    return harness.adamw(cfg.adamw_lr) if name == "adamw" else harness.sgd(cfg.sgd_lr, 0.9 if name == "sgd" else 0.0)


def _worker(rank: int, world: int, job: tuple[DPBenchConfig, Method]) -> dict[str, Any]:
    cfg, method = job
    task = harness.gpt(**cfg.task_options)
    pipe = harness.gpt_pipeline(task, PipelineConfig(
        cfg.schedule, cfg.microbatches, grad_clip_norm=cfg.clip if method.global_clip else None,
        data_parallel=DataParallelConfig(grad_compression=method.compression),
        safety=SafetyConfig(check_inputs_every_step=False)), _optimizer(method.optimizer, cfg), cfg.pp, cfg.dp)
    (trace,) = harness.RoundRobin([pipe], harness.gpt_step(task, cfg.batch_size),
                                  lambda p: (p.last.wire_bytes if p.last else 0, p.dp.compute_s)).run(cfg.steps)
    return {"losses": trace.out, "step_s": trace.wall, "wire": [w for w, _ in trace.extra],
            "compute_s": [c for _, c in trace.extra]}


def _lane_worker(rank: int, world: int, cfg: DPBenchConfig) -> dict[str, Any] | None:
    """A few steps of interleaved 1F1B with 64 KB buckets; replica 0's last timeline with its "dp" lane."""
    task = harness.gpt(**cfg.task_options)
    pipe = harness.gpt_pipeline(task, PipelineConfig(
        "interleaved-1f1b", cfg.microbatches, schedule_options={"chunks": 2}, grad_clip_norm=cfg.clip,
        data_parallel=DataParallelConfig(grad_bucket_bytes=64 * 2**10),
        safety=SafetyConfig(check_inputs_every_step=False)), harness.adamw(cfg.adamw_lr), cfg.pp, cfg.dp)
    harness.RoundRobin([pipe], harness.gpt_step(task, cfg.batch_size)).run(cfg.lane_steps)
    assert pipe.last is not None and pipe.last.timeline is not None
    merged = deep.gather_timeline(pipe.last.timeline, group=pipe.groups.pp_group)
    return merged.to_dict() if rank == 0 else None


def run_method(cfg: DPBenchConfig, method: Method) -> dict[str, Any]:
    """Train one method on pp x dp gloo processes; per-step figures averaged over the ranks."""
    ranks = harness.spawn(_worker, (cfg, method), cfg.pp * cfg.dp, 3600)
    return {"label": method.label, "optimizer": method.optimizer, "losses": ranks[0]["losses"],
            "wire": [statistics.fmean(s) for s in zip(*(r["wire"] for r in ranks), strict=True)],
            "compute_s": [statistics.fmean(s) for s in zip(*(r["compute_s"] for r in ranks), strict=True)],
            "step_s": ranks[0]["step_s"], "fewer_bytes_target": method.fewer_bytes, "loss_target": method.loss_within,
            "compression": repr(method.compression)}


def summarize(runs: list[dict[str, Any]], cfg: DPBenchConfig) -> list[dict[str, Any]]:
    """Rows: bytes ratio (run average and steady state), loss vs the same optimizer's fp32 run, time."""
    family = {"adamw": "adamw", "sgd": "sgd", "sgd0": "sgd"}  # DGC's SGD is compared with SGD + momentum
    base = {family[r["optimizer"]]: r for r in runs if r["compression"] == "None"}
    rows = []
    tail = cfg.tail
    for r in runs:
        b = base.get(family[r["optimizer"]])
        loss = statistics.fmean(r["losses"][-tail:])
        row = {"label": r["label"], "optimizer": r["optimizer"], "loss_tail": loss,
               "bytes_avg": statistics.fmean(r["wire"]), "bytes_steady": statistics.fmean(r["wire"][-tail:]),
               "step_ms": 1e3 * statistics.median(r["step_s"][5:]),
               "compute_ms": 1e3 * statistics.median(r["compute_s"][5:]),
               "fewer_bytes_target": r["fewer_bytes_target"], "loss_target": r["loss_target"]}
        if b is not None:
            row["fewer_avg"] = statistics.fmean(b["wire"]) / row["bytes_avg"]
            row["fewer_steady"] = statistics.fmean(b["wire"][-tail:]) / row["bytes_steady"]
            row["loss_rel"] = loss / statistics.fmean(b["losses"][-tail:]) - 1
            extra = (row["compute_ms"] - 1e3 * statistics.median(b["compute_s"][5:])) / 1e3
            saved = statistics.fmean(b["wire"][-tail:]) - row["bytes_steady"]
            row["break_even_Bps"] = None if r is b else (float("inf") if extra <= 0 else saved / extra)
            row["base_step_ms"] = 1e3 * statistics.median(b["step_s"][5:])
            row["met"] = None if row["fewer_bytes_target"] is None else bool(
                row["fewer_steady"] >= row["fewer_bytes_target"] and abs(row["loss_rel"]) <= row["loss_target"])
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], cfg: DPBenchConfig) -> list[list[str]]:
    """One row per method."""
    optimizer = {"adamw": f"AdamW lr {cfg.adamw_lr:g}", "sgd": f"SGD lr {cfg.sgd_lr:g} m 0.9",
                 "sgd0": f"SGD lr {cfg.sgd_lr:g} m 0 (DGC m 0.9)"}
    return [["method", "optimizer", "KB/rank/step (avg / steady)", "fewer bytes (avg / steady)", "target",
             f"loss last {cfg.tail}", "vs fp32", "target", "met", "ms/step", "reduce compute ms", "break-even"]] + [
        [r["label"], optimizer[r["optimizer"]], f"{r['bytes_avg'] / 1e3:.1f} / {r['bytes_steady'] / 1e3:.1f}",
         f"{r.get('fewer_avg', 1):.1f}x / {r.get('fewer_steady', 1):.1f}x",
         "-" if r["fewer_bytes_target"] is None else f">= {r['fewer_bytes_target']:g}x", f"{r['loss_tail']:.4f}",
         f"{r.get('loss_rel', 0):+.2%}", "-" if r["loss_target"] is None else f"within {r['loss_target']:.1%}",
         {None: "-", True: "yes", False: "**no**"}[r.get("met")], f"{r['step_ms']:.0f}", f"{r['compute_ms']:.2f}",
         "-" if (bw := r.get("break_even_Bps")) is None else
         "any link" if bw == float("inf") else f"{bw / 1e6:.0f} MB/s"] for r in rows]


def _loss_curves(runs: list[dict[str, Any]], path: str) -> None:
    """Every run's loss (10-step mean): the whole run, and the second half zoomed on the close ones."""
    fig = figure(12, 5.2, 150, None)
    whole, zoom = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    half = len(runs[0]["losses"]) // 2
    near: list[float] = []
    base = max(statistics.fmean(r["losses"][-20:]) for r in runs if r["compression"] == "None")
    for r in runs:
        smooth = [statistics.fmean(r["losses"][max(0, i - 9):i + 1]) for i in range(len(r["losses"]))]
        for ax in (whole, zoom):
            ax.plot(range(1, len(smooth) + 1), smooth, "-" if r["optimizer"] == "adamw" else "--", linewidth=1.1,
                    label=f"{r['label']} ({r['optimizer']})")
        if smooth[-1] <= 1.1 * base:
            near += smooth[half:]
    zoom.set(xlim=(half, len(runs[0]["losses"])), ylim=(min(near) - 0.02, max(near) + 0.02))
    for ax, title in ((whole, "whole run"), (zoom, "second half, methods within 10% of fp32 (others leave the frame)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(color="#DDDDDD", linewidth=0.5)
    whole.set_ylabel("training loss (mean of the last 10 steps)")
    whole.legend(fontsize=7, ncol=1)
    fig.suptitle("GPT example, PP=2 x DP=2, 1F1B: loss per data-parallel gradient compression method "
                 "(solid: AdamW, dashed: SGD)")
    fig.tight_layout()
    fig.savefig(path)


def _scatter(rows: list[dict[str, Any]], path: str) -> None:
    """Bytes per rank and step (steady state) against the loss change vs fp32 of the same optimizer."""
    fig = figure(9, 5.2, 150, None)
    ax = fig.add_subplot(1, 1, 1)
    markers = "os^vD<>pPX*h"
    for i, r in enumerate(rows):
        ax.scatter(r["bytes_steady"] / 1e3, 100 * r.get("loss_rel", 0.0), marker=markers[i % len(markers)], s=42,
                   label=f"{r['label']} ({r['optimizer']}): {100 * r.get('loss_rel', 0.0):+.2f}%", zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="#888888", linewidth=0.6)
    rel = [100 * r.get("loss_rel", 0.0) for r in rows]
    ax.set(ylim=(min(-1.0, 1.5 * min(rel)), max(1.0, 2.0 * max(rel))), title="bytes on the wire vs loss",
           xlabel="KB per rank per step on the data-parallel wire (ring model, steady state; log)",
           ylabel="loss of the last 20 steps vs fp32, same optimizer (%; symlog)")
    ax.grid(color="#DDDDDD", linewidth=0.5)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def _verdict(rows: list[dict[str, Any]]) -> str:
    """The wall-clock and break-even sentences, from the figures."""
    compressed = [r for r in rows if r.get("break_even_Bps") is not None]
    if not compressed:
        return ""
    bases = sorted({(r["optimizer"].rstrip("0"), round(r["base_step_ms"])) for r in compressed})
    slower = [r for r in compressed if r["step_ms"] > r["base_step_ms"]]
    times = ", ".join(f"{r['label']} {r['step_ms']:.0f}" for r in compressed)
    finite = [r["break_even_Bps"] for r in compressed if r["break_even_Bps"] != float("inf")]
    span = (f"between {min(finite) / 1e6:.0f} and {max(finite) / 1e6:.0f} MB/s per rank" if finite
            else "unbounded (no method cost extra compute)")
    steps = sorted(r["step_ms"] for r in rows)
    return (f"Wall-clock per step (median over the run): fp32 {', '.join(f'{o} {ms} ms' for o, ms in bases)}; "
            f"compressed {times} ms; {len(slower)} of {len(compressed)} compressed runs were slower than their fp32 "
            f"run (all runs: {steps[0]:.0f}-{steps[-1]:.0f} ms; on a loaded machine, noise). {len(finite)} of "
            f"{len(compressed)} methods spend more reduce compute than the fp32 all-reduce's copies. Break-even "
            f"bandwidth (bytes saved / extra compute per step, steady state): {span}; on a slower link a method "
            "saves more transfer time than it spends compressing, when the reduction is not hidden.")


def run(cfg: DPBenchConfig) -> Result:
    """Every selected method, the summary rows, and (lane_steps > 0) a measured step with its data-parallel lane."""
    chosen = [m for m in _methods(cfg.dgc_warmup_steps)
              if not cfg.methods or f"{m.label}|{m.optimizer}" in cfg.methods or m.label in cfg.methods]
    runs = [run_method(cfg, method) for method in chosen]
    lanes = harness.spawn(_lane_worker, cfg, cfg.pp * cfg.dp, 1800)[0] if cfg.lane_steps > 0 else None
    return {"config": asdict(replace(cfg, methods=tuple(cfg.methods))), "runs": runs, "rows": summarize(runs, cfg),
            "lane_timeline": lanes}


def report(result: Result) -> list[Block]:
    """How it ran, the table, the verdict."""
    cfg = DPBenchConfig(**{**result["config"], "methods": tuple(result["config"]["methods"])})
    return [f"GPT example ({cfg.task_options}), PP={cfg.pp} x DP={cfg.dp}, {cfg.schedule}, {cfg.microbatches} "
            f"microbatches per replica, {cfg.steps} steps, one seed; gradient clip {cfg.clip:g} (DGC: each replica's "
            f"mean gradient to {cfg.clip:g} x sqrt(DP) before its momentum). Bytes: ring-model bytes per rank and step "
            f"(the strategy's WireMeter, mean over the ranks); 'steady' and the loss: the mean of the last {cfg.tail} "
            f"steps (DGC warms up {cfg.dgc_warmup_steps} steps per sparsity stage), the loss against the fp32 run "
            "with the same optimizer (DGC: against SGD with momentum 0.9, which DGC applies in its compressor).",
            table(result["rows"], cfg), _verdict(result["rows"])]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Loss curves of every run, bytes (steady) against the loss, and a measured step with its data-parallel lane."""
    _loss_curves(result["runs"], os.path.join(folder, "dp_compression_loss.png"))
    _scatter(result["rows"], os.path.join(folder, "dp_compression_bytes_vs_loss.png"))
    out = [("dp_compression_loss.png", "Loss curves of every method"),
           ("dp_compression_bytes_vs_loss.png", "Bytes on the wire vs loss")]
    if result.get("lane_timeline"):
        from duplexpipe.viz import plot_timeline_lanes

        plot_timeline_lanes(Timeline.from_dict(result["lane_timeline"]), os.path.join(folder, "dp_lanes.png"),
                            title="Measured interleaved 1F1B step, PP=2 x DP=2 (replica 0), 64 KB buckets")
        out.append(("dp_lanes.png", "A measured step with its data-parallel lane"))
    return out


PART = Part("dp_compression", "Gradient compression in training", DPBenchConfig(), QUICK, run, report, figures,
            block="dp-compression")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
