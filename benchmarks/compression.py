"""Gradient compression micro-benchmark: per-method compute time, bytes on the wire and break-even bandwidth.

Every method reduces one bucket shaped like a GPT's parameters, on 2 gloo ranks:
- "compute" is the reduction over a 1-rank group (collectives are local copies, so this is the cost of
  compressing and decompressing), each of the 2 processes on its own core;
- "gloo" is the same reduction over the 2-rank group on this machine (loopback, shared cores);
- bytes are the ring-model bytes one rank sends per step (duplexpipe.comm.WireMeter).
Break-even bandwidth = (fp32 bytes - method bytes) / (method compute - fp32 compute): on links slower than
that (bytes per second per rank), the bytes saved outweigh the extra compute when nothing overlaps.

Usage: python benchmarks/compression.py [--reps N] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from duplexpipe.comm import (  # noqa: E402
    Bucket,
    DGCOptions,
    Int8Options,
    Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
    build_reducer,
)

METHODS: tuple[tuple[str, str | Options], ...] = (
    ("fp32 all-reduce", "none"),
    ("bf16 (torch hook)", "bf16"),
    ("fp16 (torch hook)", "fp16"),
    ("int8 blocks of 256, SR + EF", Int8Options()),
    ("powersgd rank 4", PowerSGDOptions(rank=4, start_step=2)),
    ("topk 1% + EF", TopKOptions(ratio=0.01)),
    ("randomk 1% + EF", RandomKOptions(ratio=0.01)),
    ("threshold 0.5 max, 1% slots", ThresholdOptions(ratio=0.01, theta=0.5)),
    ("dgc 99%", DGCOptions(ratio=0.01)),
    ("dgc 99.9%", DGCOptions(ratio=0.001)),
)
"""(label, compression) pairs measured; DGC without warm-up, so every timed step is at steady state."""


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    models: tuple[tuple[str, int, int], ...] = (("GPT example (4 x 64)", 4, 64), ("GPT 8 x 256", 8, 256))
    """(label, n_layer, d_model) of the GPTs whose parameter shapes make the bucket."""
    reps: int = 10
    """Timed reductions per method and group."""
    warmup: int = 3
    """Untimed reductions first (PowerSGD's exact steps included)."""
    methods: tuple[str, ...] = field(default_factory=lambda: tuple(label for label, _ in METHODS))
    """Labels of METHODS to run."""


def gpt_shapes(n_layer: int, d_model: int) -> list[tuple[int, ...]]:
    """Parameter shapes of examples/gpt.py's model (vocabulary 73, context 64)."""
    spec = importlib.util.spec_from_file_location("example_gpt", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["example_gpt"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    cfg = module.GPTConfig(d_model=d_model, n_layer=n_layer, n_head=4)
    embedding, blocks, head = module.build_gpt(cfg)
    return [tuple(p.shape) for m in (embedding, *blocks, head) for p in m.parameters()]


def _time(spec: str | Options, group: Any, bucket: Bucket, grad: torch.Tensor, cfg: BenchConfig) -> dict[str, float]:
    """Median seconds per reduction (start + finish + end_step) and ring bytes per step on `group`."""
    reducer = build_reducer(spec, group)
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


def _worker(rank: int, world: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    solo = dist.new_group([rank], use_local_synchronization=True)
    rows = []
    for label, n_layer, d_model in cfg.models:
        shapes = gpt_shapes(n_layer, d_model)
        bucket = Bucket(0, shapes)
        grad = torch.randn(bucket.buffer().numel(), generator=torch.Generator().manual_seed(rank))
        for name, spec in METHODS:
            if name not in cfg.methods:
                continue
            pair = dist.new_group(list(range(world)))  # a fresh group per reducer (PowerSGD needs its own)
            compute = _time(spec, solo, bucket, grad, cfg)
            wire = _time(spec, pair, bucket, grad, cfg)
            rows.append({"model": label, "numel": bucket.buffer().numel(), "method": name,
                         "compute_s": compute["s"], "gloo_s": wire["s"], "bytes": wire["bytes"]})
    return rows


def break_even(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratio and break-even bandwidth against the fp32 all-reduce of the same model."""
    base = {r["model"]: r for r in rows if r["method"] == METHODS[0][0]}
    out = []
    for r in rows:
        b = base[r["model"]]
        extra = r["compute_s"] - b["compute_s"]
        saved = b["bytes"] - r["bytes"]
        bandwidth = None if r is b else (float("inf") if extra <= 0 else saved / extra)
        out.append({**r, "ratio": b["bytes"] / r["bytes"], "extra_s": extra, "break_even_Bps": bandwidth})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of break_even()'s rows."""
    head = ("| bucket | method | MB/rank/step | fewer bytes | compute ms | extra ms | gloo 2-rank ms "
            "| break-even |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        bw = r["break_even_Bps"]
        shown = "-" if bw is None else ("any link" if bw == float("inf") else f"{bw / 1e9:.2f} GB/s")
        lines.append(f"| {r['model']} ({r['numel'] / 1e6:.2f}M) | {r['method']} | {r['bytes'] / 1e6:.3f} "
                     f"| {r['ratio']:.1f}x | {r['compute_s'] * 1e3:.2f} | {r['extra_s'] * 1e3:+.2f} "
                     f"| {r['gloo_s'] * 1e3:.2f} | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on 2 gloo processes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed reductions per method and group")
    parser.add_argument("--quick", action="store_true", help="the small model only, 2 reps, 3 methods")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.reps < 1:
        print(f"compression.py: --reps must be >= 1, got {args.reps}", file=sys.stderr)
        return 2
    cfg = BenchConfig(reps=args.reps)
    if args.quick:
        cfg = BenchConfig(models=cfg.models[:1], reps=2, warmup=2,
                          methods=(METHODS[0][0], METHODS[3][0], METHODS[4][0]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = break_even(harness.spawn(_worker, cfg, world=2, timeout_s=1800)[0])
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
