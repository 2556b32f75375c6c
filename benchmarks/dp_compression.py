"""Gradient compression in training: the GPT example at PP=2 x DP=2 (1F1B) per method, against fp32.

Per method: bytes on the data-parallel wire (ring model, counted by the strategy's WireMeter, per rank and
step; averaged over the run and over its last `tail` steps, the steady state), the mean loss of the last
`tail` steps against the uncompressed run with the same optimizer, wall-clock per step, and the compute the
reduction cost this rank outside waits (flatten / compress / decompress / copy back), from which the
break-even bandwidth follows: (fp32 bytes - method bytes) / (method compute - fp32 compute). On links slower
than that (bytes per second per rank), the bytes saved outweigh the extra compute when nothing overlaps.

Usage: python benchmarks/dp_compression.py [--steps N] [--methods a,b] [--json PATH] [--docs DIR]
(--docs docs: the figures go to docs/img, the section between its markers in docs/benchmarks.md; `make bench`
runs it as the part "grad_compression").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness, report  # noqa: E402
from duplexpipe.comm import (  # noqa: E402
    DGCOptions,
    Int8Options,
    Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
)
from duplexpipe.launch.train_loop import DEFAULT_TASK, load_task  # noqa: E402
from duplexpipe.parallel.mesh import make_mesh  # noqa: E402
from duplexpipe.train.trainer import Pipeline, PipelineConfig  # noqa: E402


@dataclass(frozen=True)
class Method:
    """One training run."""

    label: str
    """Row name."""
    compression: str | Options | None
    """PipelineConfig.grad_compression."""
    optimizer: str
    """"adamw" (the example's) or "sgd" (SGD, momentum 0.9) or "sgd0" (SGD without momentum, for DGC)."""
    fewer_bytes: float | None = None
    """Target: at least this many times fewer bytes than fp32 (steady state)."""
    loss_within: float | None = None
    """Target: mean loss of the last steps within this fraction of the uncompressed run's."""
    global_clip: bool = True
    """Clip the reduced gradient's global norm (DGC clips locally instead, before its momentum)."""


def _methods(warmup: int) -> tuple[Method, ...]:
    dgc = {"momentum": 0.9, "clip_norm": 1.0, "warmup_steps": warmup}
    return (
        Method("fp32 all-reduce", None, "adamw"),
        Method("bf16 (torch hook)", "bf16", "adamw", 1.95, 0.01),
        Method("fp16 (torch hook)", "fp16", "adamw"),
        Method("int8 blocks of 256, SR + EF", Int8Options(), "adamw", 3.8, 0.01),
        Method("PowerSGD rank 4", PowerSGDOptions(rank=4), "adamw", 6.0, 0.04),
        Method("fp32 all-reduce", None, "sgd"),
        Method("DGC 99%", DGCOptions(ratio=0.01, **dgc), "sgd0", 45.0, 0.015, False),  # type: ignore[arg-type]
        Method("DGC 99.9%", DGCOptions(ratio=0.001, **dgc), "sgd0", 400.0, 0.05, False),  # type: ignore[arg-type]
        Method("top-k 1% + EF", TopKOptions(ratio=0.01), "sgd"),
        Method("random-k 1% + EF", RandomKOptions(ratio=0.01), "sgd"),
        Method("threshold 0.5 max, 1% slots + EF", ThresholdOptions(ratio=0.01, theta=0.5), "sgd"),
    )


@dataclass(frozen=True)
class DPBenchConfig:
    """The workload: the GPT example's task (duplexpipe.launch.tasks.gpt), PP x DP processes."""

    steps: int = 200
    """Training steps per method."""
    tail: int = 20
    """Last steps whose loss (and bytes: the steady state) are averaged."""
    pp: int = 2
    """Pipeline ranks."""
    dp: int = 2
    """Data-parallel replicas."""
    schedule: str = "1f1b"
    """Schedule."""
    microbatches: int = 4
    """Microbatches per step and replica."""
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})
    """gpt_task options (the example's model)."""
    batch_size: int = 32
    """Sequences per step over all replicas (the example's global batch)."""
    adamw_lr: float = 3e-3
    """The example's AdamW learning rate (weight decay 0.01)."""
    sgd_lr: float = 0.1
    """SGD learning rate (momentum 0.9; DGC: its compressor's momentum 0.9, SGD without momentum)."""
    clip: float = 1.0
    """Global gradient-norm clip (the example's); DGC clips locally instead: each replica's mean gradient,
    over its whole model, to clip * sqrt(DP) before the momentum (comm.dgc.local_clip_threshold)."""
    dgc_warmup_steps: int = 10
    """DGC: steps at each warm-up sparsity (75%, 93.75%, 98.4375%, 99.6%) below its target."""
    methods: tuple[str, ...] = ()
    """Labels (with optimizer, "label|opt") to run; empty: all."""
    lane_steps: int = 6
    """Steps of the run whose last timeline shows the data-parallel lane (0: no such run)."""


def _optimizer(name: str, cfg: DPBenchConfig) -> Any:
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=cfg.adamw_lr, weight_decay=0.01)
    momentum = 0.9 if name == "sgd" else 0.0
    return lambda ps: torch.optim.SGD(ps, lr=cfg.sgd_lr, momentum=momentum)


def _worker(rank: int, world: int, job: tuple[DPBenchConfig, Method]) -> dict[str, Any]:
    cfg, method = job
    torch.manual_seed(0)
    task = load_task(DEFAULT_TASK)(**cfg.task_options)
    pcfg = PipelineConfig(cfg.schedule, cfg.microbatches, grad_clip_norm=cfg.clip if method.global_clip else None,
                          grad_compression=method.compression, check_inputs_every_step=False)
    pipe = Pipeline.from_layers(task.layers, task.loss_fn, _optimizer(method.optimizer, cfg), pcfg,
                                embedding=task.embedding, head=task.head, mesh=make_mesh(cfg.pp, cfg.dp))
    losses, wire, step_s, compute_s = [], [], [], []
    share = None
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        share = x.shape[0] // cfg.dp
        lo = pipe.groups.dp_rank * share
        begin = time.perf_counter()
        losses.append(pipe.step(x[lo:lo + share], y[lo:lo + share]))
        step_s.append(time.perf_counter() - begin)
        assert pipe.last is not None
        wire.append(pipe.last.wire_bytes)
        compute_s.append(pipe.dp.compute_s)
    return {"losses": losses, "wire": wire, "step_s": step_s, "compute_s": compute_s, "rank": rank,
            "params": sum(p.numel() for p in pipe.params)}


def _lane_worker(rank: int, world: int, cfg: DPBenchConfig) -> dict[str, Any] | None:
    """A few steps of interleaved 1F1B (two stages per rank) with 64 KB buckets; the last step's timeline of
    data-parallel replica 0, gathered over its pipeline, with its "dp" lane."""
    from duplexpipe.runtime import gather_timeline

    torch.manual_seed(0)
    task = load_task(DEFAULT_TASK)(**cfg.task_options)
    pcfg = PipelineConfig("interleaved-1f1b", cfg.microbatches, schedule_options={"chunks": 2},
                          grad_clip_norm=cfg.clip, grad_bucket_bytes=64 * 2**10, check_inputs_every_step=False)
    pipe = Pipeline.from_layers(task.layers, task.loss_fn, _optimizer("adamw", cfg), pcfg,
                                embedding=task.embedding, head=task.head, mesh=make_mesh(cfg.pp, cfg.dp))
    for step in range(cfg.lane_steps):
        x, y = task.batch(step, cfg.batch_size)
        share = x.shape[0] // cfg.dp
        pipe.step(x[pipe.groups.dp_rank * share:][:share], y[pipe.groups.dp_rank * share:][:share])
    assert pipe.last is not None and pipe.last.timeline is not None
    merged = gather_timeline(pipe.last.timeline, group=pipe.groups.pp_group)
    return merged.to_dict() if rank == 0 else None


def lane_timeline(cfg: DPBenchConfig) -> dict[str, Any]:
    """The measured timeline (as a dict) whose "dp" lane shows what overlapped (see _lane_worker)."""
    result = harness.spawn(_lane_worker, cfg, world=cfg.pp * cfg.dp, timeout_s=1800)[0]
    assert result is not None
    return result


def run_method(cfg: DPBenchConfig, method: Method) -> dict[str, Any]:
    """Train one method on pp x dp gloo processes; per-step figures averaged over the ranks."""
    ranks = harness.spawn(_worker, (cfg, method), world=cfg.pp * cfg.dp, timeout_s=3600)
    n = len(ranks)
    return {"label": method.label, "optimizer": method.optimizer, "losses": ranks[0]["losses"],
            "wire": [sum(r["wire"][s] for r in ranks) / n for s in range(cfg.steps)],
            "step_s": [max(r["step_s"][s] for r in ranks) for s in range(cfg.steps)],
            "compute_s": [sum(r["compute_s"][s] for r in ranks) / n for s in range(cfg.steps)],
            "fewer_bytes_target": method.fewer_bytes, "loss_target": method.loss_within,
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
            row["met"] = _met(row)
        rows.append(row)
    return rows


def _met(row: dict[str, Any]) -> bool | None:
    if row["fewer_bytes_target"] is None:
        return None
    return bool(row["fewer_steady"] >= row["fewer_bytes_target"] and abs(row["loss_rel"]) <= row["loss_target"])


def _opt_text(name: str, cfg: DPBenchConfig) -> str:
    return {"adamw": f"AdamW lr {cfg.adamw_lr:g}", "sgd": f"SGD lr {cfg.sgd_lr:g} m 0.9",
            "sgd0": f"SGD lr {cfg.sgd_lr:g} m 0 (DGC m 0.9)"}[name]


def table(rows: list[dict[str, Any]], cfg: DPBenchConfig) -> str:
    """The markdown table of summarize()'s rows."""
    out = ["| method | optimizer | KB/rank/step (avg / steady) | fewer bytes (avg / steady) | target | "
           "loss last 20 | vs fp32 | target | met | ms/step | reduce compute ms | break-even |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = r.get("break_even_Bps")
        shown = "-" if bw is None else ("any link" if bw == float("inf") else f"{bw / 1e6:.0f} MB/s")
        met = {None: "-", True: "yes", False: "**no**"}[r.get("met")]
        fb, lt = r["fewer_bytes_target"], r["loss_target"]
        out.append(
            f"| {r['label']} | {_opt_text(r['optimizer'], cfg)} | {r['bytes_avg'] / 1e3:.1f} / "
            f"{r['bytes_steady'] / 1e3:.1f} | {r.get('fewer_avg', 1):.1f}x / {r.get('fewer_steady', 1):.1f}x | "
            f"{'-' if fb is None else f'>= {fb:g}x'} | {r['loss_tail']:.4f} | {r.get('loss_rel', 0):+.2%} | "
            f"{'-' if lt is None else f'within {lt:.1%}'} | {met} | {r['step_ms']:.0f} | {r['compute_ms']:.2f} "
            f"| {shown} |")
    return "\n".join(out)


def _loss_curves(runs: list[dict[str, Any]], path: str) -> None:
    """Every run's loss (10-step mean): the whole run, and the second half zoomed on the close ones."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.2), dpi=150)
    whole, zoom = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    half = len(runs[0]["losses"]) // 2
    near: list[float] = []
    base = max(statistics.fmean(r["losses"][-20:]) for r in runs if r["compression"] == "None")
    for r in runs:
        smooth = [statistics.fmean(r["losses"][max(0, i - 9):i + 1]) for i in range(len(r["losses"]))]
        style = "-" if r["optimizer"] == "adamw" else "--"
        label = f"{r['label']} ({r['optimizer']})"
        for ax in (whole, zoom):
            ax.plot(range(1, len(smooth) + 1), smooth, style, linewidth=1.1, label=label)
        if smooth[-1] <= 1.1 * base:
            near += smooth[half:]
    zoom.set_xlim(half, len(runs[0]["losses"]))
    zoom.set_ylim(min(near) - 0.02, max(near) + 0.02)
    whole.set_title("whole run", fontsize=10)
    zoom.set_title("second half, methods within 10% of fp32 (others leave the frame)", fontsize=10)
    for ax in (whole, zoom):
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
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.2), dpi=150)
    ax = fig.add_subplot(1, 1, 1)
    markers = "os^vD<>pPX*h"
    for i, r in enumerate(rows):
        ax.scatter(r["bytes_steady"] / 1e3, 100 * r.get("loss_rel", 0.0), marker=markers[i % len(markers)], s=42,
                   label=f"{r['label']} ({r['optimizer']}): {100 * r.get('loss_rel', 0.0):+.2f}%", zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="#888888", linewidth=0.6)
    rel = [100 * r.get("loss_rel", 0.0) for r in rows]
    ax.set_ylim(min(-1.0, 1.5 * min(rel)), max(1.0, 2.0 * max(rel)))
    ax.set_xlabel("KB per rank per step on the data-parallel wire (ring model, steady state; log)")
    ax.set_ylabel("loss of the last 20 steps vs fp32, same optimizer (%; symlog)")
    ax.set_title("bytes on the wire vs loss")
    ax.grid(color="#DDDDDD", linewidth=0.5)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def figures(runs: list[dict[str, Any]], rows: list[dict[str, Any]], img_dir: str) -> list[str]:
    """Loss curves of every run in one figure, and bytes (steady) against the loss; returns the paths."""
    os.makedirs(img_dir, exist_ok=True)
    loss_path = os.path.join(img_dir, "dp_compression_loss.png")
    scatter_path = os.path.join(img_dir, "dp_compression_bytes_vs_loss.png")
    _loss_curves(runs, loss_path)
    _scatter(rows, scatter_path)
    return [loss_path, scatter_path]


BEGIN = "<!-- bench:dp-compression:begin -->"
END = "<!-- bench:dp-compression:end -->"


def _verdict(rows: list[dict[str, Any]]) -> str:
    """The wall-clock and break-even sentences, from the figures."""
    compressed = [r for r in rows if r.get("break_even_Bps") is not None]
    if not compressed:
        return ""
    bases = sorted({(r["optimizer"].rstrip("0"), round(r["base_step_ms"])) for r in compressed})
    slower = [r for r in compressed if r["step_ms"] > r["base_step_ms"]]
    costlier = [r for r in compressed if r["break_even_Bps"] != float("inf")]
    times = ", ".join(f"{r['label']} {r['step_ms']:.0f}" for r in compressed)
    finite = [r["break_even_Bps"] for r in costlier]
    span = (f"between {min(finite) / 1e6:.0f} and {max(finite) / 1e6:.0f} MB/s per rank" if finite
            else "unbounded (no method cost extra compute)")
    steps = sorted(r["step_ms"] for r in rows)
    return (f"Wall-clock per step (median over the run): fp32 {', '.join(f'{o} {ms} ms' for o, ms in bases)}; "
            f"compressed {times} ms; {len(slower)} of {len(compressed)} compressed runs were slower than their "
            f"fp32 run. On this loaded machine step times of identical work move by tens of percent between "
            f"runs (all runs: {steps[0]:.0f}-{steps[-1]:.0f} ms), so these differences are noise, not a speed-up. "
            f"What is not noise is the reduce compute: {len(costlier)} of {len(compressed)} methods spend more "
            "CPU flattening, compressing and decompressing than the fp32 all-reduce's copies. The data-parallel "
            "'wire' here is gloo over loopback on 2 shared cores, a copy by the same CPUs that run the model, so "
            "the bytes saved buy nothing: compression costs more than it saves on this machine and pays only "
            "on a real network link. Break-even bandwidth (bytes saved per step / extra compute per step, "
            f"steady state): {span}; on a link slower than that (per rank) a method saves more transfer time "
            "than it spends compressing, when the reduction is not hidden behind the backward.")


def markdown(result: dict[str, Any], figure_links: list[tuple[str, str]]) -> str:
    """The docs section: how it ran, the table, the verdict, the figures."""
    cfg = DPBenchConfig(**{**result["config"], "methods": tuple(result["config"]["methods"])})
    meta = result.get("meta", {})
    lines = [
        f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}` ({meta.get('wall_s', 0):.0f} s wall); "
        f"load average (1, 5, 15 min) before {meta.get('load_before', '?')}, after "
        f"{[round(x, 2) for x in result['loadavg']]} (`uptime` at the start: {meta.get('uptime', '?')}).",
        "",
        f"GPT example (examples/gpt.py: {cfg.task_options}), PP={cfg.pp} x DP={cfg.dp}, {cfg.schedule}, "
        f"{cfg.microbatches} microbatches per replica, {cfg.steps} steps, one seed; global gradient clip "
        f"{cfg.clip:g} (the example's) except for DGC, which clips each replica's mean gradient (over its whole "
        f"model, both pipeline stages) to {cfg.clip:g} x sqrt(DP) before its momentum instead (local clipping, "
        "as in the paper: N^-1/2 of the threshold for a node's 1/N share of the summed gradient). "
        "Bytes are ring-model bytes per rank and step counted by the strategy's WireMeter (averaged over the 4 "
        f"ranks); 'steady' is the mean of the last {cfg.tail} steps (after DGC's warm-up of "
        f"{cfg.dgc_warmup_steps} steps per sparsity stage and PowerSGD's 10 exact steps); loss is the mean of "
        f"the last {cfg.tail} steps against the fp32 run with the same optimizer (DGC rows: against SGD with "
        "momentum 0.9; DGC runs SGD without momentum and applies momentum 0.9 in its compressor).",
        "",
        table(result["rows"], cfg),
        "",
        _verdict(result["rows"]),
        "",
    ]
    lines += [f"![{caption}]({link})" for link, caption in figure_links]
    return "\n".join(lines)


def publish(result: dict[str, Any], docs: str) -> None:
    """Figures into docs/img and the section between BEGIN and END of docs/benchmarks.md."""
    paths = figures(result["runs"], result["rows"], os.path.join(docs, "img"))
    links = [(f"img/{os.path.basename(paths[0])}", "Loss curves of every method"),
             (f"img/{os.path.basename(paths[1])}", "Bytes on the wire vs loss")]
    if result.get("lane_timeline"):
        from duplexpipe.schedules.timeline import Timeline
        from duplexpipe.viz.lanes import plot_timeline_lanes

        timeline = Timeline.from_dict(result["lane_timeline"])
        plot_timeline_lanes(timeline, os.path.join(docs, "img", "dp_lanes.png"),
                            title="Measured interleaved 1F1B step, PP=2 x DP=2 (replica 0), 64 KB buckets")
        links.append(("img/dp_lanes.png", "A measured step with its data-parallel lane"))
    report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(result, links), BEGIN, END)


def run(cfg: DPBenchConfig) -> dict[str, Any]:
    """Every selected method, then the summary rows."""
    chosen = [m for m in _methods(cfg.dgc_warmup_steps)
              if not cfg.methods or f"{m.label}|{m.optimizer}" in cfg.methods or m.label in cfg.methods]
    runs = []
    for method in chosen:
        begin = time.monotonic()
        runs.append(run_method(cfg, method))
        print(f"[{method.label} ({method.optimizer}): {time.monotonic() - begin:.0f} s]", file=sys.stderr, flush=True)
    lanes = lane_timeline(cfg) if cfg.lane_steps > 0 else None
    return {"config": {**asdict(replace(cfg, methods=tuple(cfg.methods)))}, "runs": runs,
            "rows": summarize(runs, cfg), "loadavg": list(os.getloadavg()), "lane_timeline": lanes}


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, optionally write JSON and figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--methods", default="", help="comma list of labels (or label|optimizer); default all")
    parser.add_argument("--sgd-lr", type=float, default=DPBenchConfig.sgd_lr)
    parser.add_argument("--json", type=Path, help="write runs and rows as JSON here")
    parser.add_argument("--docs", default="", help="docs directory: figures in DIR/img, section in DIR/benchmarks.md")
    parser.add_argument("--replot", type=Path, help="measure nothing: publish this earlier --json output")
    args = parser.parse_args(argv)
    if args.steps < 25:
        print(f"dp_compression.py: --steps must be >= 25 (the last 20 are averaged), got {args.steps}",
              file=sys.stderr)
        return 2
    cfg = DPBenchConfig(steps=args.steps, sgd_lr=args.sgd_lr,
                        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()))
    if args.replot:
        result = json.loads(args.replot.read_text(encoding="utf-8"))
        cfg = DPBenchConfig(**{**result["config"], "methods": tuple(result["config"]["methods"])})
        result["rows"] = summarize(result["runs"], cfg)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        started, load_before, uptime = time.monotonic(), [round(x, 2) for x in os.getloadavg()], _uptime()
        result = run(cfg)
        result["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.monotonic() - started,
                          "command": "python benchmarks/dp_compression.py " + " ".join(argv or sys.argv[1:]),
                          "load_before": load_before, "uptime": uptime}
    print(table(result["rows"], cfg))
    print(_verdict(result["rows"]))
    report.save_and_publish(result, args.json, args.docs, publish)
    return 0


def _uptime() -> str:
    try:
        import subprocess

        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
