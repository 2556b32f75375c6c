"""Part: low-precision stage-to-stage sends on the GPT example: bytes per SEND, loss and step time vs fp32 sends."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, figure, mark
from benchmarks.internals import TensorSpec, p2p_codec_pair
from duplexpipe import PipelineConfig, build_schedule
from duplexpipe.train.pipeline_config import ObserveConfig, PrecisionConfig, SafetyConfig

LABELS = ("fp32", "bf16", "fp8", "int8")  # fp32 sends (p2p_compression=None) and the three compressions
TARGET_RATIO = MappingProxyType({"bf16": 0.5, "fp8": 0.27, "int8": 0.27})  # bytes per SEND over fp32's, at most
TARGET_LOSS = 0.01  # |mean of the last losses - fp32's| / fp32's, at most


@dataclass(frozen=True)
class P2PConfig:
    """Per schedule, one spawn trains a Pipeline per variant from the same weights, round-robin on the same batches."""

    schedules: tuple[str, ...] = ("dualpipe", "1f1b")  # schedules, one spawn each
    ranks: int = 4  # pipeline ranks (gloo processes)
    microbatches: int = 8  # microbatches per step
    steps: int = 200  # training steps of every variant
    last: int = 20  # the loss figure is the mean of this many last steps
    d_model: int = 64  # GPT width (the last dimension of every message: fp8 sends one scale per row of it)
    batch_size: int = 32  # sequences per step (each of 64 characters)
    lr: float = 3e-3  # AdamW learning rate

    def __post_init__(self) -> None:
        if self.steps < self.last:
            raise ValueError(f"steps must be >= last ({self.last}), got {self.steps}")


QUICK = P2PConfig(schedules=("dualpipe",), ranks=2, microbatches=4, steps=3, last=2, d_model=32, batch_size=8)


def _worker(rank: int, world: int, job: tuple[str, P2PConfig]) -> dict[str, Any]:
    name, cfg = job
    task = harness.gpt(n_layer=build_schedule(name, world, cfg.microbatches).num_groups, d_model=cfg.d_model)
    pipes = [harness.gpt_pipeline(task, PipelineConfig(
        schedule=name, num_microbatches=cfg.microbatches, grad_clip_norm=1.0,
        observe=ObserveConfig(record_timeline=False), safety=SafetyConfig(check_inputs_every_step=False),
        precision=PrecisionConfig(p2p_compression=None if label == "fp32" else label)), harness.adamw(cfg.lr))
        for label in LABELS]
    runs = list(zip(LABELS, pipes, harness.RoundRobin(pipes, harness.gpt_step(task, cfg.batch_size)).run(cfg.steps),
                    strict=True))
    return {"losses": {k: t.out for k, _, t in runs}, "seconds": {k: t.wall for k, _, t in runs},
            "meters": {k: p.p2p_meter.snapshot() for k, p, _ in runs},
            "nonfinite": {k: p.runtime.nonfinite.events for k, p, _ in runs}}


def codec_seconds(cfg: P2PConfig, reps: int = 200) -> dict[str, float]:
    """Median seconds to encode and decode one activation message, per variant, on one thread (like a rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(cfg.batch_size // cfg.microbatches, 64, cfg.d_model, generator=torch.Generator().manual_seed(0))
    out = {}
    try:
        for label in LABELS[1:]:
            codec, _ = p2p_codec_pair(label)
            assert codec is not None
            samples = []
            for _ in range(reps):
                begin = time.perf_counter()
                codec.decode(codec.encode(x), TensorSpec.of(x))
                samples.append(time.perf_counter() - begin)
            out[label] = statistics.median(samples)
    finally:
        torch.set_num_threads(threads)
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
    return [{**r, "bytes_ratio": r["bytes_per_send"] / base["bytes_per_send"], "time_ratio": r["step"]["median_s"]
             / base["step"]["median_s"], "loss_rel": (r["loss_last"] - base["loss_last"]) / base["loss_last"]}
            for r in rows]


def run(cfg: P2PConfig) -> Result:
    """Train every schedule's variants; the rows, the codecs' own cost and the configuration."""
    rows = [row for name in cfg.schedules for row in summarize(name, harness.spawn(_worker, (name, cfg), cfg.ranks,
                                                                                     3600), cfg)]
    return {"rows": rows, "codec_s": codec_seconds(cfg), "config": asdict(cfg)}


def report(result: Result) -> list[Block]:
    """One row per (schedule, variant)."""
    table = [["schedule", "sends", "bytes per SEND", "vs fp32", "target", "met", f"loss, mean of last "
              f"{result['config']['last']}", "vs fp32", "met (1%)", "step ms (median)", "vs fp32", "encode+decode ms",
              "NaN/inf sends"]]
    for r in result["rows"]:
        fp32 = r["variant"] == "fp32"
        codec = result["codec_s"].get(r["variant"])
        table.append([f"{r['schedule']}, {r['variant']}", str(r["sends"]), f"{r['bytes_per_send']:,.0f}",
                      f"{r['bytes_ratio']:.4f}", "-" if fp32 else f"<= {TARGET_RATIO[r['variant']]:g}",
                      "-" if fp32 else mark(r["bytes_ratio"] <= TARGET_RATIO[r["variant"]]), f"{r['loss_last']:.4f}",
                      f"{r['loss_rel']:+.2%}", "-" if fp32 else mark(abs(r["loss_rel"]) <= TARGET_LOSS),
                      f"{r['step']['median_s'] * 1e3:.1f}", f"{r['time_ratio']:.2f}x",
                      "-" if codec is None else f"{codec * 1e3:.3f}", str(r["nonfinite_sends"])])
    return [table]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Loss curves per schedule (top) and each variant's loss relative to fp32 sends' (bottom)."""
    schedules = list(dict.fromkeys(r["schedule"] for r in result["rows"]))
    fig = figure(5.2 * len(schedules), 6.4)
    axes = fig.subplots(2, len(schedules), squeeze=False)
    cfg = result["config"]
    window = max(1, cfg["steps"] // 25)
    for col, name in enumerate(schedules):
        rows = {r["variant"]: r for r in result["rows"] if r["schedule"] == name}
        base = torch.tensor(rows["fp32"]["losses"])
        for c, label in enumerate(LABELS):
            loss = torch.tensor(rows[label]["losses"])
            axes[0, col].plot(range(1, len(loss) + 1), loss.tolist(), color=f"C{c}", linewidth=1.0, label=label)
            smooth = torch.nn.functional.avg_pool1d(((loss - base) / base).view(1, 1, -1), window, 1).view(-1)
            axes[1, col].plot(range(window, len(loss) + 1), (100 * smooth).tolist(), color=f"C{c}", linewidth=1.0,
                              label=label)
        axes[0, col].set_title(f"{name}: training loss, {cfg['ranks']} gloo ranks, GPT example", fontsize=9.5)
        axes[0, col].set_ylabel("loss", fontsize=8.5)
        axes[0, col].legend(fontsize=7.5)
        for bound in (-1, 1):
            axes[1, col].axhline(bound, color="#c0392b", linestyle="--", linewidth=0.8)
        axes[1, col].set_title(f"loss vs fp32 sends, % ({window}-step mean; target band +-1%)", fontsize=9)
        axes[1, col].set(xlabel="step", ylabel="%")
    fig.savefig(os.path.join(folder, "p2p_loss.png"))
    return [("p2p_loss.png", "Loss with low-precision sends vs fp32 sends")]


PART = Part("p2p_compression", "Low-precision stage-to-stage sends", P2PConfig(), QUICK, run, report, figures,
            block="p2p")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
