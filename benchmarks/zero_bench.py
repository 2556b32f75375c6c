"""ZeRO benchmark on the GPT example: memory per rank by ZeRO stage, and ZeRO++ bytes and loss.

1. Memory: after two AdamW steps, every rank sums the sizes of the tensors it holds: per-element optimizer
   state, gradients kept after the step (parameters' .grad; ZeRO-1 also its flat gradient buffers and
   shards), parameters (local shards under ZeRO-2). Layouts PP x DP = 2 x 1, 2 x 2 and 1 x 4.
2. ZeRO++: PP=2 x DP=2, 1F1B, `steps` steps per run: bytes per rank and step on the data-parallel wire by
   collective (ring model, the strategy's WireMeter, cross-checked over the first steps against a c10d
   dispatch counter), the mean loss of the last `tail` steps against the unquantized run of the same stage,
   wall-clock per step.
3. Speed: zero_stage 0, 1 and 2 built side by side in the same 4 processes (PP=2 x DP=2) and stepped in
   turn, so each sees the same machine load: wall-clock and CPU seconds (process time: the rank's threads,
   gloo's included) per step, and ZeRO-2 over ZeRO-1.

Usage: python benchmarks/zero_bench.py [--steps N] [--d-model D] [--speed-only] [--json PATH] [--docs DIR]
(`make bench` runs it as the part "zero"; --docs writes the section between its markers in DIR/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness, report  # noqa: E402
from duplexpipe.comm import C10dCounter, WireMeter  # noqa: E402
from duplexpipe.launch.train_loop import DEFAULT_TASK, load_task  # noqa: E402
from duplexpipe.parallel import ZeroOptions  # noqa: E402
from duplexpipe.parallel.mesh import make_mesh  # noqa: E402
from duplexpipe.train.trainer import Pipeline, PipelineConfig  # noqa: E402

LAYOUTS = ((2, 1), (2, 2), (1, 4))
"""(PP, DP) of the memory table."""
SHARDED_KINDS = ("reduce_scatter", "all_to_all", "all_gather")
"""The collectives only ZeRO posts (the dispatch cross-check compares these)."""
BOTH = ZeroOptions(quantized_gradients=True, quantized_weights=True)
RUNS: tuple[tuple[str, int, ZeroOptions], ...] = (
    ("zero_stage=0 (all-reduce)", 0, ZeroOptions()),
    ("ZeRO-1", 1, ZeroOptions()),
    ("ZeRO-1 + qgZ", 1, ZeroOptions(quantized_gradients=True)),
    ("ZeRO-1 + qwZ", 1, ZeroOptions(quantized_weights=True)),
    ("ZeRO-1 + qgZ + qwZ", 1, BOTH),
    ("ZeRO-2", 2, ZeroOptions()),
    ("ZeRO-2 + qgZ", 2, ZeroOptions(quantized_gradients=True)),
    ("ZeRO-2 + qwZ", 2, ZeroOptions(quantized_weights=True)),
    ("ZeRO-2 + qgZ + qwZ", 2, BOTH),
)
"""(label, zero_stage, options) of the ZeRO++ runs."""


@dataclass(frozen=True)
class ZeroBenchConfig:
    """The workload: examples/gpt.py's task."""

    steps: int = 200
    """Training steps per ZeRO++ run."""
    tail: int = 20
    """Last steps whose loss and bytes are averaged."""
    memory_steps: int = 2
    """Steps before the memory is read."""
    microbatches: int = 4
    """Microbatches per step and replica."""
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})
    """gpt_task options (the example's model)."""
    batch_size: int = 32
    """Global batch (sequences per step, split over the data-parallel replicas)."""
    lr: float = 3e-3
    """AdamW learning rate (weight decay 0.01, the example's)."""
    clip: float = 1.0
    """Global gradient-norm clip."""
    checked_steps: int = 3
    """Steps whose collectives are also counted by the c10d dispatch counter."""
    runs: tuple[str, ...] = ()
    """Labels of the ZeRO++ runs to do; empty: all."""
    speed_steps: int = 60
    """Timed steps of each stage in the side-by-side speed run (after `speed_warmup`)."""
    speed_warmup: int = 5
    """Untimed steps of each stage first."""


def _pipeline(cfg: ZeroBenchConfig, pp: int, dp: int, stage: int, zero: ZeroOptions) -> tuple[Pipeline, Any]:
    torch.manual_seed(0)
    task = load_task(DEFAULT_TASK)(**cfg.task_options)
    pcfg = PipelineConfig("1f1b", cfg.microbatches, grad_clip_norm=cfg.clip, zero_stage=stage, zero=zero,
                          check_inputs_every_step=False)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=0.01)  # noqa: E731
    pipe = Pipeline.from_layers(task.layers, task.loss_fn, optimizer, pcfg, embedding=task.embedding,
                                head=task.head, mesh=make_mesh(pp, dp))
    return pipe, task


def _step(pipe: Pipeline, task: Any, step: int, batch_size: int) -> float:
    x, y = task.batch(step, batch_size)
    share = x.shape[0] // pipe.groups.dp_size
    lo = pipe.groups.dp_rank * share
    return pipe.step(x[lo:lo + share], y[lo:lo + share])


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t  # type: ignore[no-any-return]


def held_bytes(pipe: Pipeline) -> dict[str, int]:
    """Bytes of the tensors this rank holds (see the module doc)."""
    state = [t for s in pipe.optimizer.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim()]
    grads = [p.grad for p in pipe.params if p.grad is not None]
    sharded = getattr(pipe.dp, "sharded", None)
    if sharded is not None:
        grads += [f.grads for f in sharded.flats]  # the shards are views into these
    return {name: sum(_local(t).numel() * _local(t).element_size() for t in ts)
            for name, ts in (("state", state), ("grads", grads), ("params", pipe.params))}


def _memory_worker(rank: int, world: int, job: tuple[ZeroBenchConfig, int, int]) -> dict[int, dict[str, int]]:
    cfg, pp, dp = job
    out = {}
    for stage in (0, 1, 2):
        pipe, task = _pipeline(cfg, pp, dp, stage, ZeroOptions())
        for step in range(cfg.memory_steps):
            _step(pipe, task, step, cfg.batch_size)
        out[stage] = held_bytes(pipe)
    return out


def memory(cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """One row per (layout, stage): the largest per-rank figure of each kind, and the ratio to stage 0."""
    rows = []
    for pp, dp in LAYOUTS:
        ranks = harness.spawn(_memory_worker, (cfg, pp, dp), world=pp * dp, timeout_s=900)
        for stage in (0, 1, 2):
            worst = {k: max(r[stage][k] for r in ranks) for k in ("state", "grads", "params")}
            base = {k: max(r[0][k] for r in ranks) for k in ("state", "grads", "params")}
            rows.append({"pp": pp, "dp": dp, "stage": stage, **worst,
                         **{f"{k}_frac": worst[k] / base[k] for k in worst}})
    return rows


@contextmanager
def _counted(meter: WireMeter, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with C10dCounter(meter):
        yield


def _train_worker(rank: int, world: int, job: tuple[ZeroBenchConfig, int, ZeroOptions]) -> dict[str, Any]:
    cfg, stage, zero = job
    pipe, task = _pipeline(cfg, 2, 2, stage, zero)
    meter = pipe.dp.meter
    seen, own = WireMeter(), WireMeter()
    losses, step_s, kinds = [], [], []
    for step in range(cfg.steps):
        before = dict(meter.bytes)
        check = 1 <= step <= cfg.checked_steps and stage > 0
        begin = time.perf_counter()
        with _counted(seen, check):
            losses.append(_step(pipe, task, step, cfg.batch_size))
        step_s.append(time.perf_counter() - begin)
        kinds.append({k: meter.bytes[k] - before.get(k, 0.0) for k in meter.bytes})
        if check:
            for k in SHARDED_KINDS:
                if kinds[-1].get(k):
                    own.bytes[k] += kinds[-1][k]
    dispatch = {k: seen.bytes.get(k, 0.0) for k in SHARDED_KINDS}
    return {"losses": losses, "step_s": step_s, "kinds": kinds,
            "meter_matches_dispatch": stage == 0 or dispatch == {k: own.bytes.get(k, 0.0) for k in SHARDED_KINDS}}


SPEED_STAGES = (0, 1, 2)
"""The zero_stage values of the speed run."""


def _speed_worker(rank: int, world: int, cfg: ZeroBenchConfig) -> dict[int, dict[str, list[float]]]:
    pipes = {stage: _pipeline(cfg, 2, 2, stage, ZeroOptions()) for stage in SPEED_STAGES}
    out: dict[int, dict[str, list[float]]] = {stage: {"wall": [], "cpu": []} for stage in SPEED_STAGES}
    for step in range(cfg.speed_warmup + cfg.speed_steps):
        for stage, (pipe, task) in pipes.items():
            wall, cpu = time.perf_counter(), time.process_time()
            _step(pipe, task, step, cfg.batch_size)
            if step >= cfg.speed_warmup:
                out[stage]["wall"].append(time.perf_counter() - wall)
                out[stage]["cpu"].append(time.process_time() - cpu)
    return out


def speed(cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """Per stage: median wall ms per step (slowest rank each step) and mean CPU ms per step and rank."""
    ranks = harness.spawn(_speed_worker, cfg, world=4, timeout_s=1800)
    return speed_rows(ranks)


def speed_rows(ranks: list[dict[int, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """speed()'s rows from each rank's per-step seconds."""
    rows = []
    for stage in SPEED_STAGES:
        steps = len(ranks[0][stage]["wall"])
        wall = [max(r[stage]["wall"][i] for r in ranks) for i in range(steps)]
        rows.append({"stage": stage, "wall_ms": 1e3 * statistics.median(wall),
                     "cpu_ms": 1e3 * statistics.fmean(c for r in ranks for c in r[stage]["cpu"])})
    one = next(r for r in rows if r["stage"] == 1)
    for r in rows:
        r["wall_vs_1"], r["cpu_vs_1"] = r["wall_ms"] / one["wall_ms"], r["cpu_ms"] / one["cpu_ms"]
    return rows


def speed_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per stage, wall and CPU ms per step and their ratio to ZeRO-1's."""
    out = ["| zero_stage | wall ms/step (median) | vs ZeRO-1 | CPU ms/step and rank (mean) | vs ZeRO-1 |",
           "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['stage']} | {r['wall_ms']:.1f} | {r['wall_vs_1']:.2f}x | {r['cpu_ms']:.1f} | "
                   f"{r['cpu_vs_1']:.2f}x |")
    return "\n".join(out)


def run_zero_pp(cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """The ZeRO++ runs at PP=2 x DP=2 (per-step bytes averaged over the ranks)."""
    out = []
    for label, stage, zero in RUNS:
        if cfg.runs and label not in cfg.runs:
            continue
        begin = time.monotonic()
        ranks = harness.spawn(_train_worker, (cfg, stage, zero), world=4, timeout_s=3600)
        kinds = sorted({k for r in ranks for s in r["kinds"] for k in s})
        per_kind = {k: [statistics.fmean(r["kinds"][s].get(k, 0.0) for r in ranks) for s in range(cfg.steps)]
                    for k in kinds}
        out.append({"label": label, "stage": stage, "losses": ranks[0]["losses"], "bytes": per_kind,
                    "step_s": [max(r["step_s"][s] for r in ranks) for s in range(cfg.steps)],
                    "meter_matches_dispatch": all(r["meter_matches_dispatch"] for r in ranks)})
        print(f"[{label}: {time.monotonic() - begin:.0f} s]", file=sys.stderr, flush=True)
    return out


def summarize(runs: list[dict[str, Any]], cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """Per run: steady bytes by collective, the gradient and weight halves against the exact run of the same
    stage, the loss of the last `tail` steps against it, the median step time."""
    tail = cfg.tail
    exact = {r["stage"]: r for r in runs if "+" not in r["label"]}
    rows = []
    for r in runs:
        steady = {k: statistics.fmean(v[-tail:]) for k, v in r["bytes"].items()}
        grads = steady.get("reduce_scatter", 0.0) + steady.get("all_to_all", 0.0) + steady.get("all_reduce", 0.0)
        row = {"label": r["label"], "stage": r["stage"], "grad_bytes": grads,
               "weight_bytes": steady.get("all_gather", 0.0), "loss_tail": statistics.fmean(r["losses"][-tail:]),
               "step_ms": 1e3 * statistics.median(r["step_s"][3:]), "checked": r["meter_matches_dispatch"]}
        base = exact.get(r["stage"])
        if base is not None and base is not r:
            b = {k: statistics.fmean(v[-tail:]) for k, v in base["bytes"].items()}
            row["grad_fewer"] = (b.get("reduce_scatter", 0.0) + b.get("all_to_all", 0.0)) / grads
            row["weight_fewer"] = b.get("all_gather", 0.0) / row["weight_bytes"] if row["weight_bytes"] else None
            row["loss_rel"] = row["loss_tail"] / statistics.fmean(base["losses"][-tail:]) - 1
        if r["stage"] == 1 and 0 in exact and r is exact[1]:
            row["same_losses_as_stage0"] = r["losses"] == exact[0]["losses"]
        rows.append(row)
    return rows


def memory_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: bytes per rank (largest over the ranks) and the fraction of zero_stage=0's."""
    out = ["| PP x DP | zero_stage | optimizer state KB | vs 0 | gradients KB (after the step) | vs 0 | "
           "parameters KB | vs 0 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['pp']} x {r['dp']} | {r['stage']} | {r['state'] / 1e3:.1f} | {r['state_frac']:.3f} | "
                   f"{r['grads'] / 1e3:.1f} | {r['grads_frac']:.3f} | {r['params'] / 1e3:.1f} | "
                   f"{r['params_frac']:.3f} |")
    return "\n".join(out)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def zero_pp_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: bytes by half, ratios against the same stage's exact run, loss, met/missed, time."""
    out = ["| run | gradient KB/rank/step | fewer | weight KB/rank/step | fewer | loss last 20 | vs exact | "
           "target (>= 3.5x, within 1%) | ms/step | meter = dispatch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel, ratios = r.get("loss_rel"), _quantized_ratios(r)
        met = "-" if rel is None or not ratios else (
            "met" if abs(rel) <= 0.01 and all(f >= 3.5 for f in ratios) else "**missed**")
        out.append(f"| {r['label']} | {r['grad_bytes'] / 1e3:.1f} | {_x(r.get('grad_fewer'))} | "
                   f"{r['weight_bytes'] / 1e3:.1f} | {_x(r.get('weight_fewer'))} | {r['loss_tail']:.4f} | "
                   f"{'-' if rel is None else f'{rel:+.2%}'} | {met} | {r['step_ms']:.0f} | "
                   f"{'yes' if r['checked'] else '**no**'} |")
    return "\n".join(out)


def _quantized_ratios(row: dict[str, Any]) -> list[float]:
    """The ratios the targets apply to: the gradient half under qgZ, the weight half under qwZ."""
    out = []
    if "qgZ" in row["label"] and row.get("grad_fewer") is not None:
        out.append(row["grad_fewer"])
    if "qwZ" in row["label"] and row.get("weight_fewer") is not None:
        out.append(row["weight_fewer"])
    return out


BEGIN = "<!-- bench:zero:begin -->"
END = "<!-- bench:zero:end -->"


def markdown(result: dict[str, Any]) -> str:
    """The docs section."""
    cfg = ZeroBenchConfig(**{**result["config"], "runs": tuple(result["config"]["runs"])})
    meta = result.get("meta", {})
    same = [r for r in result["rows"] if "same_losses_as_stage0" in r]
    lines = [
        f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}` ({meta.get('wall_s', 0):.0f} s wall); load "
        f"average (1, 5, 15 min) before {meta.get('load_before', '?')}, after "
        f"{[round(x, 2) for x in result['loadavg']]}; `uptime` before: {result.get('uptime_before', '?')}.",
        "",
        f"**Memory per rank** (GPT example {cfg.task_options}, batch {cfg.batch_size}, AdamW, after "
        f"{cfg.memory_steps} steps; largest rank; 'vs 0' = fraction of zero_stage=0 in the same layout). At DP=1 "
        "there is nothing to shard: "
        "zero_stage 1 and 2 fall back to the replicated strategy (with a warning).",
        "",
        memory_table(result["memory"]),
        "",
        f"**ZeRO++** (PP=2 x DP=2, 1F1B, {cfg.microbatches} microbatches per replica, {cfg.steps} steps, AdamW "
        f"lr {cfg.lr:g}, clip {cfg.clip:g}, one seed). Bytes: ring-model bytes per rank and step, mean of the last "
        f"{cfg.tail} steps; gradient half = reduce-scatter (qgZ: all_to_all), weight half = all-gather; 'fewer' "
        f"and the loss (mean of the last {cfg.tail} steps) are against the unquantized run of the same stage. "
        "int8 blocks of 256 with fp32 scales: qgZ rounds stochastically, qwZ to nearest. 'meter = dispatch': over "
        f"steps 1..{cfg.checked_steps} the WireMeter's reduce-scatter / all_to_all / all-gather bytes equal a "
        "c10d dispatch counter's.",
        "",
        zero_pp_table(result["rows"]),
        "",
    ]
    if same:
        lines.append("ZeRO-1's losses over all steps are " + ("bit-identical" if same[0]["same_losses_as_stage0"]
                     else "**not** identical") + " to zero_stage=0's.")
    if result.get("speed"):
        lines += ["", f"**Speed** (the same model and layout; zero_stage 0, 1 and 2 built side by side in the same "
                  f"4 processes and stepped in turn, {cfg.speed_warmup} untimed then {cfg.speed_steps} timed "
                  "steps each, so all three see the same load; wall: median over steps of the slowest rank; "
                  "CPU: process time per step and rank, gloo's threads included; target: ZeRO-2 within 1.2x "
                  "of ZeRO-1).", "", speed_table(result["speed"])]
    return "\n".join(lines)


def publish(result: dict[str, Any], docs: str) -> None:
    """The section between BEGIN and END of docs/benchmarks.md."""
    report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(result), BEGIN, END)


def run(cfg: ZeroBenchConfig) -> dict[str, Any]:
    """The memory table, then the ZeRO++ runs and their summary."""
    before = harness.uptime()
    mem = memory(cfg)
    fast = speed(cfg)
    runs = run_zero_pp(cfg)
    return {"config": asdict(cfg), "memory": mem, "speed": fast, "runs": runs, "rows": summarize(runs, cfg),
            "loadavg": list(os.getloadavg()), "uptime_before": before}


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, optionally write JSON and the docs section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=ZeroBenchConfig.steps)
    parser.add_argument("--runs", default="", help="comma list of run labels; default all")
    parser.add_argument("--speed-only", action="store_true", help="only the side-by-side speed run")
    parser.add_argument("--d-model", type=int, default=64, help="the GPT's width (default 64)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--docs", default="", help="docs directory: section in DIR/benchmarks.md")
    args = parser.parse_args(argv)
    if args.steps < 25:
        print(f"zero_bench.py: --steps must be >= 25 (the last 20 are averaged), got {args.steps}", file=sys.stderr)
        return 2
    cfg = ZeroBenchConfig(steps=args.steps, runs=tuple(r.strip() for r in args.runs.split(",") if r.strip()),
                          task_options={"n_layer": 4, "d_model": args.d_model})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    started, load_before = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    if args.speed_only:
        print(speed_table(speed(cfg)))
        return 0
    result = run(cfg)
    result["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.monotonic() - started,
                      "command": "python benchmarks/zero_bench.py " + " ".join(argv or sys.argv[1:]),
                      "load_before": load_before}
    print(markdown(result))
    report.save_and_publish(result, args.json, args.docs, publish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
