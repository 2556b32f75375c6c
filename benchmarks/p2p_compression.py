"""Low-precision stage-to-stage sends on the GPT example: bytes per SEND, loss after N steps and step time vs fp32.

For each schedule (DualPipe, 1F1B), one spawn of 4 gloo processes builds one `Pipeline` per compression
(fp32 sends, "bf16", "fp8", "int8") from the same weights and partition, and trains them round-robin on
the same batches (step i of every pipeline, starting with a different one each step, then step i+1), so
every variant sees the same machine load. Reported per variant:
- bytes per SEND: the payload bytes the transport posted (`Pipeline.p2p_meter`), over the SEND count;
- the mean of the last 20 losses against fp32 sends' (the issue's target: within 1%);
- the median step time (slowest rank) against fp32 sends': on gloo over shared cores encoding is CPU
  work and the bytes saved are cheap loopback copies, so this is a cost, not a speedup;
- encode + decode time of one message in one process, and sends whose tensor held NaN/inf.

Usage: python benchmarks/p2p_compression.py [--steps N] [--quick] [--out DIR] [--docs DIR|none] [--load-note TEXT]
       python benchmarks/p2p_compression.py --replot   (tables, figure and docs again from OUT/p2p.json)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness, report  # noqa: E402
from duplexpipe.comm.codec import TensorSpec  # noqa: E402
from duplexpipe.comm.p2p_codecs import p2p_codec_pair  # noqa: E402
from duplexpipe.launch.tasks.gpt import gpt_task  # noqa: E402
from duplexpipe.pipeline import Pipeline, PipelineConfig  # noqa: E402
from duplexpipe.schedules.registry import build as build_schedule  # noqa: E402

LABELS = ("fp32", "bf16", "fp8", "int8")
"""Variants: fp32 sends (p2p_compression=None) and the three compressions."""
TARGET_RATIO = {"bf16": 0.5, "fp8": 0.27, "int8": 0.27}
"""Bytes per SEND over fp32's, at most."""
TARGET_LOSS = 0.01
"""|mean of the last losses - fp32's| / fp32's, at most."""
BEGIN, END = "<!-- bench:p2p:begin -->", "<!-- bench:p2p:end -->"


@dataclass(frozen=True)
class P2PConfig:
    """What one run trains."""

    schedules: tuple[str, ...] = ("dualpipe", "1f1b")
    """Schedules, one spawn each."""
    ranks: int = 4
    """Pipeline ranks (gloo processes)."""
    microbatches: int = 8
    """Microbatches per step."""
    steps: int = 200
    """Training steps of every variant."""
    last: int = 20
    """The loss figure is the mean of this many last steps."""
    d_model: int = 64
    """GPT width (the last dimension of every message: fp8 sends one scale per row of it)."""
    batch_size: int = 32
    """Sequences per step (each of 64 characters)."""
    lr: float = 3e-3
    """AdamW learning rate."""


def quick_config() -> P2PConfig:
    """A smoke configuration: DualPipe on 2 ranks, 3 steps, a narrower model."""
    return P2PConfig(schedules=("dualpipe",), ranks=2, microbatches=4, steps=3, last=2, d_model=32, batch_size=8)


def _worker(rank: int, world: int, arg: tuple[str, P2PConfig]) -> dict[str, Any]:
    name, cfg = arg
    torch.manual_seed(0)
    n_layer = build_schedule(name, world, cfg.microbatches).num_groups  # one block per model part
    task = gpt_task(n_layer=n_layer, d_model=cfg.d_model)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    pipes = {}
    for label in LABELS:
        config = PipelineConfig(schedule=name, num_microbatches=cfg.microbatches, grad_clip_norm=1.0,
                                record_timeline=False, check_inputs_every_step=False,
                                p2p_compression=None if label == "fp32" else label)
        pipes[label] = Pipeline.from_layers(task.layers, task.loss_fn, adamw, config,
                                            embedding=task.embedding, head=task.head)
    losses: dict[str, list[float]] = {label: [] for label in LABELS}
    seconds: dict[str, list[float]] = {label: [] for label in LABELS}
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        for k in range(len(LABELS)):
            label = LABELS[(step + k) % len(LABELS)]
            took, loss = harness.timed(functools.partial(pipes[label].step, x, y))
            losses[label].append(loss)
            seconds[label].append(took)
    return {"losses": losses, "seconds": seconds,
            "meters": {label: p.p2p_meter.snapshot() for label, p in pipes.items()},
            "nonfinite": {label: p.runtime.nonfinite.events for label, p in pipes.items()}}


def codec_seconds(cfg: P2PConfig, reps: int = 200) -> dict[str, float]:
    """Median seconds to encode and decode one activation message, per variant (one thread, like a rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _codec_seconds(cfg, reps)
    finally:
        torch.set_num_threads(threads)


def _codec_seconds(cfg: P2PConfig, reps: int) -> dict[str, float]:
    rows = cfg.batch_size // cfg.microbatches
    x = torch.randn(rows, 64, cfg.d_model, generator=torch.Generator().manual_seed(0))
    out = {}
    for label in LABELS[1:]:
        codec, _ = p2p_codec_pair(label)
        assert codec is not None
        samples = []
        for _ in range(reps):
            begin = time.perf_counter()
            codec.decode(codec.encode(x), TensorSpec.of(x))
            samples.append(time.perf_counter() - begin)
        out[label] = statistics.median(samples)
    return out


def summarize(name: str, per_rank: list[dict[str, Any]], cfg: P2PConfig) -> list[dict[str, Any]]:
    """One row per variant: bytes per send, loss vs fp32, step time vs fp32 (slowest rank per step)."""
    lead = per_rank[0]
    rows = []
    for label in LABELS:
        sends = sum(r["meters"][label]["calls"].get("send", 0) for r in per_rank)
        nbytes = sum(r["meters"][label]["bytes"].get("send", 0.0) for r in per_rank)
        losses = lead["losses"][label]
        rows.append({"schedule": name, "variant": label, "sends": sends, "bytes_per_send": nbytes / sends,
                     "loss_last": statistics.fmean(losses[-cfg.last:]), "losses": losses,
                     "step": harness.summarize(lead["seconds"][label]).to_dict(),
                     "nonfinite_sends": sum(r["nonfinite"][label] for r in per_rank)})
    base = rows[0]
    for row in rows:
        row["bytes_ratio"] = row["bytes_per_send"] / base["bytes_per_send"]
        row["loss_rel"] = (row["loss_last"] - base["loss_last"]) / base["loss_last"]
        row["time_ratio"] = row["step"]["median_s"] / base["step"]["median_s"]
    return rows


def run(cfg: P2PConfig) -> dict[str, Any]:
    """Train every schedule's variants; the rows, the codecs' own cost and the configuration."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = []
    for name in cfg.schedules:
        per_rank = harness.spawn(_worker, (name, cfg), world=cfg.ranks, timeout_s=3600)
        rows += summarize(name, per_rank, cfg)
    return {"rows": rows, "codec_s": codec_seconds(cfg), "config": asdict(cfg)}


def _met(row: dict[str, Any]) -> tuple[str, str]:
    if row["variant"] == "fp32":
        return "-", "-"
    ratio = report._mark(row["bytes_ratio"] <= TARGET_RATIO[row["variant"]])
    return ratio, report._mark(abs(row["loss_rel"]) <= TARGET_LOSS)


def table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per (schedule, variant)."""
    cfg = part["config"]
    out = [["schedule", "sends", "bytes per SEND", "vs fp32", "target", "met",
            f"loss, mean of last {cfg['last']}", "vs fp32", "met (1%)", "step ms (median)", "vs fp32",
            "encode+decode ms", "NaN/inf sends"]]
    for r in part["rows"]:
        ratio_met, loss_met = _met(r)
        target = "-" if r["variant"] == "fp32" else f"<= {TARGET_RATIO[r['variant']]:g}"
        codec = part["codec_s"].get(r["variant"])
        out.append([f"{r['schedule']}, {r['variant']}", str(r["sends"]), f"{r['bytes_per_send']:,.0f}",
                    f"{r['bytes_ratio']:.4f}", target, ratio_met, f"{r['loss_last']:.4f}",
                    f"{r['loss_rel']:+.2%}", loss_met, f"{r['step']['median_s'] * 1e3:.1f}",
                    f"{r['time_ratio']:.2f}x", "-" if codec is None else f"{codec * 1e3:.3f}",
                    str(r["nonfinite_sends"])])
    return out


def loss_figure(part: dict[str, Any], path: str) -> None:
    """Loss curves per schedule (top) and each variant's loss relative to fp32 sends' (bottom)."""
    from matplotlib.figure import Figure

    schedules = list(dict.fromkeys(r["schedule"] for r in part["rows"]))
    fig = Figure(figsize=(5.2 * len(schedules), 6.4), dpi=110, layout="constrained")
    axes = fig.subplots(2, len(schedules), squeeze=False)
    window = max(1, part["config"]["steps"] // 25)
    for col, name in enumerate(schedules):
        rows = {r["variant"]: r for r in part["rows"] if r["schedule"] == name}
        base = torch.tensor(rows["fp32"]["losses"])
        for c, label in enumerate(LABELS):
            loss = torch.tensor(rows[label]["losses"])
            steps = range(1, len(loss) + 1)
            axes[0, col].plot(steps, loss.tolist(), color=f"C{c}", linewidth=1.0, label=label)
            rel = (loss - base) / base
            smooth = torch.nn.functional.avg_pool1d(rel.view(1, 1, -1), window, 1).view(-1)
            axes[1, col].plot(range(window, len(loss) + 1), (100 * smooth).tolist(), color=f"C{c}",
                              linewidth=1.0, label=label)
        axes[0, col].set_title(f"{name}: training loss, {part['config']['ranks']} gloo ranks, GPT example",
                               fontsize=9.5)
        axes[0, col].set_ylabel("loss", fontsize=8.5)
        axes[0, col].legend(fontsize=7.5)
        for bound in (-1, 1):
            axes[1, col].axhline(bound, color="#c0392b", linestyle="--", linewidth=0.8)
        axes[1, col].set_title(f"loss vs fp32 sends, % ({window}-step mean; target band +-1%)", fontsize=9)
        axes[1, col].set_xlabel("step", fontsize=8.5)
        axes[1, col].set_ylabel("%", fontsize=8.5)
    fig.savefig(path)


def markdown(part: dict[str, Any], figure: str | None) -> str:
    """The generated block of docs/benchmarks.md's low-precision section."""
    meta = part.get("meta", {})
    lines = [f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}` ({meta.get('wall_s', 0):.0f} s wall); "
             f"load average before / after: {meta.get('load_before', '?')} / {meta.get('load_after', '?')}. "
             f"{meta.get('load_note', '')}", "", report.markdown_table(table(part)), ""]
    if figure:
        lines += [f"![Loss with low-precision sends vs fp32 sends]({figure})", ""]
    return "\n".join(lines)


def publish(part: dict[str, Any], docs: str) -> None:
    """Draw the loss figure into docs/img and rewrite the low-precision block of docs/benchmarks.md."""
    os.makedirs(os.path.join(docs, "img"), exist_ok=True)
    loss_figure(part, os.path.join(docs, "img", "p2p_loss.png"))
    report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(part, "img/p2p_loss.png"), BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write OUT/p2p.json and (unless --docs none) the docs section and figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=P2PConfig.steps, help="training steps per variant")
    parser.add_argument("--quick", action="store_true", help="DualPipe on 2 ranks, 3 steps, a narrower model")
    parser.add_argument("--out", default=str(ROOT / "bench-output"), help="results directory")
    parser.add_argument("--docs", default=str(ROOT / "docs"), help="docs directory to update; 'none' to skip")
    parser.add_argument("--load-note", default="", help="how loaded the machine was, for the docs")
    parser.add_argument("--replot", action="store_true", help="measure nothing: redraw from OUT/p2p.json")
    args = parser.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "p2p.json"), encoding="utf-8") as fh:
            return _show(json.load(fh), args.docs)
    cfg = quick_config() if args.quick else P2PConfig(steps=args.steps)
    if cfg.steps < cfg.last:
        print(f"p2p_compression.py: --steps must be >= {cfg.last}, got {args.steps}", file=sys.stderr)
        return 2
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.monotonic()
    part = run(cfg)
    given = list(sys.argv[1:] if argv is None else argv)
    if "--load-note" in given:  # the note is shown on its own
        given[given.index("--load-note") + 1] = "NOTE"
    part["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.monotonic() - started,
                    "command": shlex.join(["python", "benchmarks/p2p_compression.py", *given]),
                    "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
                    "load_note": args.load_note, "machine": harness.machine_info()}
    report.write_json(part, os.path.join(args.out, "p2p.json"))
    return _show(part, args.docs)


def _show(part: dict[str, Any], docs: str) -> int:
    print(report.text_table(table(part)))
    if docs != "none":
        publish(part, docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
