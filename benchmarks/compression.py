"""Part: gradient compression alone: per-method compute time, bytes on the wire and break-even bandwidth."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result
from duplexpipe.launch.tasks.gpt import GPTConfig, build_gpt

METHODS: tuple[tuple[str, str | deep.Options], ...] = (
    ("fp32 all-reduce", "none"), ("bf16 (torch hook)", "bf16"), ("fp16 (torch hook)", "fp16"),
    ("int8 blocks of 256, SR + EF", deep.Int8Options()),
    ("powersgd rank 4", deep.PowerSGDOptions(rank=4, start_step=2)),
    ("topk 1% + EF", deep.TopKOptions(ratio=0.01)), ("randomk 1% + EF", deep.RandomKOptions(ratio=0.01)),
    ("threshold 0.5 max, 1% slots", deep.ThresholdOptions(ratio=0.01, theta=0.5)),
    ("dgc 99%", deep.DGCOptions(ratio=0.01)), ("dgc 99.9%", deep.DGCOptions(ratio=0.001)),
)  # (label, compression) measured; DGC without warm-up: every timed step at steady state


@dataclass(frozen=True)
class CompressionConfig:
    """Each method reduces a bucket shaped like a GPT's parameters on 2 gloo ranks: "compute" over a 1-rank group (the
    cost of compressing and decompressing), "gloo" over both; bytes: the ring-model bytes a rank sends per step."""

    models: tuple[tuple[str, int, int], ...] = (("GPT example (4 x 64)", 4, 64), ("GPT 8 x 256", 8, 256))
    """(label, n_layer, d_model) of the GPTs whose parameter shapes make the bucket."""
    reps: int = 10  # timed reductions per method and group
    warmup: int = 3  # untimed reductions first (PowerSGD's exact steps included)
    methods: tuple[str, ...] = tuple(label for label, _ in METHODS)  # labels of METHODS to run

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")


QUICK = CompressionConfig(models=CompressionConfig.models[:1], reps=2, warmup=2,
                          methods=(METHODS[0][0], METHODS[3][0], METHODS[4][0]))


def gpt_shapes(n_layer: int, d_model: int) -> list[tuple[int, ...]]:
    """Parameter shapes of the demo GPT (vocabulary 73, context 64)."""
    embedding, blocks, head = build_gpt(GPTConfig(d_model=d_model, n_layer=n_layer, n_head=4))
    return [tuple(p.shape) for m in (embedding, *blocks, head) for p in m.parameters()]


def _time(spec: Any, group: Any, bucket: Any, grad: torch.Tensor, cfg: CompressionConfig) -> dict[str, float]:
    """Median seconds per reduction (start + finish + end_step) and ring bytes per step on `group`."""
    reducer = deep.build_reducer(spec, group)
    samples = []
    for rep in range(cfg.warmup + cfg.reps):
        if rep == cfg.warmup:
            reducer.meter.reset()
        bucket.buffer().copy_(grad)
        dist.barrier(group=group)
        begin = time.perf_counter()
        reducer.start(bucket).finish()
        reducer.end_step(True)
        samples.append(time.perf_counter() - begin)
    return {"s": statistics.median(samples[cfg.warmup:]), "bytes": reducer.meter.total_bytes / cfg.reps}


def _worker(rank: int, world: int, cfg: CompressionConfig) -> list[dict[str, Any]]:
    solo = dist.new_group([rank], use_local_synchronization=True)
    rows = []
    for label, n_layer, d_model in cfg.models:
        bucket = deep.Bucket(0, gpt_shapes(n_layer, d_model))
        grad = torch.randn(bucket.buffer().numel(), generator=torch.Generator().manual_seed(rank))
        for name, spec in (m for m in METHODS if m[0] in cfg.methods):
            pair = dist.new_group(list(range(world)))  # a fresh group per reducer (PowerSGD needs its own)
            compute, wire = _time(spec, solo, bucket, grad, cfg), _time(spec, pair, bucket, grad, cfg)
            rows.append({"model": label, "numel": bucket.buffer().numel(), "method": name, "compute_s": compute["s"],
                         "gloo_s": wire["s"], "bytes": wire["bytes"]})
    return rows


def break_even(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratio and break-even bandwidth against the same model's fp32 all-reduce."""
    base = {r["model"]: r for r in rows if r["method"] == METHODS[0][0]}
    out = []
    for r in rows:
        b = base[r["model"]]
        extra, saved = r["compute_s"] - b["compute_s"], b["bytes"] - r["bytes"]
        bandwidth = None if r is b else (float("inf") if extra <= 0 else saved / extra)
        out.append({**r, "ratio": b["bytes"] / r["bytes"], "extra_s": extra, "break_even_Bps": bandwidth})
    return out


def run(cfg: CompressionConfig) -> Result:
    """The rows of 2 gloo ranks."""
    return {"rows": break_even(harness.spawn(_worker, cfg, 2, 1800)[0])}


def report(result: Result) -> list[Block]:
    """One row per (bucket, method)."""
    return [[["bucket", "method", "MB/rank/step", "fewer bytes", "compute ms", "extra ms", "gloo 2-rank ms",
              "break-even"]] + [
        [f"{r['model']} ({r['numel'] / 1e6:.2f}M)", r["method"], f"{r['bytes'] / 1e6:.3f}", f"{r['ratio']:.1f}x",
         f"{r['compute_s'] * 1e3:.2f}", f"{r['extra_s'] * 1e3:+.2f}", f"{r['gloo_s'] * 1e3:.2f}",
         "-" if (bw := r["break_even_Bps"]) is None else "any link" if bw == float("inf") else f"{bw / 1e9:.2f} GB/s"]
        for r in result["rows"]]]


PART = Part("compression", "Gradient compression micro-benchmark", CompressionConfig(), QUICK, run, report,
            in_bench=False)

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
