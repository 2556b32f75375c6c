"""Part: ZeRO on the GPT example: memory per rank by stage, ZeRO++ bytes and loss, ZeRO-2 vs ZeRO-1 speed."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import Tensor

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, Table
from benchmarks.internals import C10dCounter, WireMeter
from duplexpipe import Pipeline, PipelineConfig, ZeroOptions
from duplexpipe.train.pipeline_config import DataParallelConfig, SafetyConfig

LAYOUTS = ((2, 1), (2, 2), (1, 4))  # (PP, DP) of the memory table
SHARDED_KINDS = ("reduce_scatter", "all_to_all", "all_gather")  # the collectives only ZeRO posts (cross-checked)
RUNS: tuple[tuple[str, int, ZeroOptions], ...] = (("zero_stage=0 (all-reduce)", 0, ZeroOptions()), *(
    (f"ZeRO-{stage}{' + qgZ' * g}{' + qwZ' * w}", stage, ZeroOptions(quantized_gradients=g, quantized_weights=w))
    for stage in (1, 2) for g, w in ((False, False), (True, False), (False, True), (True, True))))
"""(label, zero_stage, options) of the ZeRO++ runs."""
AREAS = (
    ("FSDP2 hooks and bookkeeping", ("torch/distributed/fsdp/",)), ("DTensor", ("torch/distributed/tensor/",)),
    ("dynamo-disable wrappers (FSDP2's)", ("torch/_dynamo/",)),
    ("profiler record_function (FSDP2's)", ("torch/autograd/profiler", "_record_function", "torch/_ops.py")),
    ("optimizer", ("torch/optim/",)), ("autograd engine (backward kernels, hooks)", ("run_backward",)),
    ("nn.Module calls (hook dispatch)", ("torch/nn/modules/module.py",)),
    ("the model (GPT forward)", ("duplexpipe/launch/tasks/", "torch/nn/functional.py", "torch/nn/modules/")),
    ("duplexpipe", ("duplexpipe/",)),
)  # (area, substrings of a profiled function's file or name that put it there); the rest is 'other'


def area_of(filename: str, name: str) -> str:
    """The area a profiled function belongs to (first match in AREAS)."""
    where = f"{filename}:{name}"
    return next((area for area, keys in AREAS if any(k in where for k in keys)), "other (kernels, Python)")


@dataclass(frozen=True)
class ZeroBenchConfig:
    """The GPT example: memory per rank in each of LAYOUTS; ZeRO++ bytes (cross-checked against c10d) and loss at
    PP=2 x DP=2; stages 0-2 built side by side in the same 4 processes and stepped in turn (wall and CPU per step)."""

    steps: int = 200  # training steps per ZeRO++ run
    tail: int = 20  # last steps whose loss and bytes are averaged
    memory_steps: int = 2  # steps before the memory is read
    microbatches: int = 4  # microbatches per step and replica
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})  # gpt_task options
    batch_size: int = 32  # global batch (sequences per step, split over the data-parallel replicas)
    lr: float = 3e-3  # AdamW learning rate (weight decay 0.01, the example's)
    clip: float = 1.0  # global gradient-norm clip
    checked_steps: int = 3  # steps whose collectives are also counted by the c10d dispatch counter
    runs: tuple[str, ...] = ()  # labels of the ZeRO++ runs to do; empty: all
    speed_steps: int = 60  # timed steps of each stage in the side-by-side speed run (after `speed_warmup`)
    speed_warmup: int = 5  # untimed steps of each stage first
    sections: tuple[str, ...] = ("memory", "speed", "zero_pp")  # the runs to do; "profile": where ZeRO-2's CPU goes
    profile_steps: int = 30  # the profile: cProfiled steps of ZeRO-1 and ZeRO-2 each (after 5 unprofiled)

    def __post_init__(self) -> None:
        if self.steps < self.tail + 3:
            raise ValueError(f"steps must be >= tail + 3 = {self.tail + 3} (the first 3 are not timed), got "
                             f"{self.steps}")


QUICK = ZeroBenchConfig(steps=6, tail=2, checked_steps=2, speed_steps=2, speed_warmup=1,
                        runs=("ZeRO-1", "ZeRO-1 + qgZ + qwZ"), task_options={"n_layer": 2, "d_model": 32})


def pipeline(cfg: ZeroBenchConfig, pp: int, dp: int, stage: int, zero: ZeroOptions) -> tuple[Pipeline, Any]:
    """The GPT example's Pipeline at this layout and ZeRO stage, and its task."""
    task = harness.gpt(**cfg.task_options)
    pcfg = PipelineConfig("1f1b", cfg.microbatches, grad_clip_norm=cfg.clip,
                          data_parallel=DataParallelConfig(zero_stage=stage, zero=zero),
                          safety=SafetyConfig(check_inputs_every_step=False))
    return harness.gpt_pipeline(task, pcfg, harness.adamw(cfg.lr), pp, dp), task


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t  # type: ignore[no-any-return]


def held_bytes(pipe: Pipeline) -> dict[str, int]:
    """Bytes of the tensors this rank holds: optimizer state, gradients kept after the step, parameters."""
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
        pipe, task = pipeline(cfg, pp, dp, stage, ZeroOptions())
        harness.RoundRobin([pipe], harness.gpt_step(task, cfg.batch_size)).run(cfg.memory_steps)
        out[stage] = held_bytes(pipe)
    return out


def memory(cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """One row per (layout, stage): the largest per-rank figure of each kind, and the ratio to stage 0."""
    rows = []
    for pp, dp in LAYOUTS:
        ranks = harness.spawn(_memory_worker, (cfg, pp, dp), pp * dp, 900)
        worst = [{k: max(r[stage][k] for r in ranks) for k in ("state", "grads", "params")} for stage in (0, 1, 2)]
        rows += [{"pp": pp, "dp": dp, "stage": stage, **w, **{f"{k}_frac": w[k] / worst[0][k] for k in w}}
                 for stage, w in enumerate(worst)]
    return rows


def _train_worker(rank: int, world: int, job: tuple[ZeroBenchConfig, int, ZeroOptions]) -> dict[str, Any]:
    cfg, stage, zero = job
    pipe, task = pipeline(cfg, 2, 2, stage, zero)
    seen, own = WireMeter(), WireMeter()
    base = harness.gpt_step(task, cfg.batch_size)

    def step(p: Pipeline, i: int) -> tuple[float, dict[str, float]]:
        before, checked = dict(p.dp.meter.bytes), 1 <= i <= cfg.checked_steps and stage > 0
        with C10dCounter(seen) if checked else nullcontext():
            loss = base(p, i)
        kinds = {k: p.dp.meter.bytes[k] - before.get(k, 0.0) for k in p.dp.meter.bytes}
        for k in SHARDED_KINDS if checked else ():
            own.bytes[k] += kinds.get(k, 0.0)
        return loss, kinds

    (trace,) = harness.RoundRobin([pipe], step).run(cfg.steps)
    dispatch = {k: seen.bytes.get(k, 0.0) for k in SHARDED_KINDS}
    return {"losses": [loss for loss, _ in trace.out], "step_s": trace.wall, "kinds": [k for _, k in trace.out],
            "meter_matches_dispatch": stage == 0 or dispatch == {k: own.bytes.get(k, 0.0) for k in SHARDED_KINDS}}


def _profile_worker(rank: int, world: int, cfg: ZeroBenchConfig) -> dict[str, dict[str, float]]:
    """The speed run of ZeRO-1 and ZeRO-2, each under cProfile (process time); rank 0's CPU ms per step by area."""
    pipes = {stage: pipeline(cfg, 2, 2, stage, ZeroOptions())[0] for stage in (1, 2)}
    profiles = {stage: cProfile.Profile(time.process_time) for stage in pipes}
    step = harness.gpt_step(harness.gpt(**cfg.task_options), cfg.batch_size)
    for i in range(5 + cfg.profile_steps):
        for stage, pipe in pipes.items():
            if i >= 5:
                profiles[stage].enable()
            step(pipe, i)
            profiles[stage].disable()
    return {str(stage): charged(pstats.Stats(p).stats, cfg.profile_steps)  # type: ignore[attr-defined]
            for stage, p in profiles.items()}


def charged(stats: dict[Any, Any], steps: int) -> dict[str, float]:
    """CPU ms per step by area: each function's own time goes to its area; a function of no area (a builtin, a
    standard library helper) is charged to its callers' areas, split as cProfile timed it under each caller."""
    areas: Counter[str] = Counter()
    for (filename, _, name), (_, _, own, _, callers) in stats.items():
        area = area_of(filename, name)
        if area.startswith("other") and callers:
            under = sum(c[2] for c in callers.values()) or 1.0
            for (cfile, _, cname), c in callers.items():
                areas[area_of(cfile, cname)] += 1e3 * own * (c[2] / under) / steps
        else:
            areas[area] += 1e3 * own / steps
    return dict(areas)


SPEED_STAGES = (0, 1, 2)  # the zero_stage values of the speed run


def _speed_worker(rank: int, world: int, cfg: ZeroBenchConfig) -> dict[int, dict[str, list[float]]]:
    built = [pipeline(cfg, 2, 2, stage, ZeroOptions()) for stage in SPEED_STAGES]
    traces = harness.RoundRobin([p for p, _ in built], harness.gpt_step(built[0][1], cfg.batch_size)).run(
        cfg.speed_steps, cfg.speed_warmup)
    return {stage: {"wall": t.wall, "cpu": t.cpu} for stage, t in zip(SPEED_STAGES, traces, strict=True)}


def speed_rows(ranks: list[dict[int, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """speed()'s rows from each rank's per-step seconds."""
    rows = [{"stage": stage, "wall_ms": 1e3 * statistics.median(harness.slowest([r[stage]["wall"] for r in ranks])),
             "cpu_ms": 1e3 * statistics.fmean(c for r in ranks for c in r[stage]["cpu"])} for stage in SPEED_STAGES]
    one = rows[SPEED_STAGES.index(1)]
    return [{**r, "wall_vs_1": r["wall_ms"] / one["wall_ms"], "cpu_vs_1": r["cpu_ms"] / one["cpu_ms"]} for r in rows]


def run_zero_pp(cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """The ZeRO++ runs at PP=2 x DP=2 (per-step bytes averaged over the ranks)."""
    out = []
    for label, stage, zero in RUNS:
        if cfg.runs and label not in cfg.runs:
            continue
        ranks = harness.spawn(_train_worker, (cfg, stage, zero), 4, 3600)
        per_kind = {k: [statistics.fmean(r["kinds"][s].get(k, 0.0) for r in ranks) for s in range(cfg.steps)]
                    for k in sorted({k for r in ranks for s in r["kinds"] for k in s})}
        out.append({"label": label, "stage": stage, "losses": ranks[0]["losses"], "bytes": per_kind,
                    "step_s": ranks[0]["step_s"], "meter_matches_dispatch": all(r["meter_matches_dispatch"]
                                                                                for r in ranks)})
    return out


def summarize(runs: list[dict[str, Any]], cfg: ZeroBenchConfig) -> list[dict[str, Any]]:
    """Per run: steady bytes, halves and loss against the same stage's exact run, the median step time."""
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


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _quantized_ratios(row: dict[str, Any]) -> list[float]:
    """The ratios the targets apply to: the gradient half under qgZ, the weight half under qwZ."""
    return [row[key] for tag, key in (("qgZ", "grad_fewer"), ("qwZ", "weight_fewer"))
            if tag in row["label"] and row.get(key) is not None]


def report(result: Result) -> list[Block]:
    """The memory table, the ZeRO++ table, the speed table (the runs done)."""
    cfg = ZeroBenchConfig(**{**result["config"], "runs": tuple(result["config"]["runs"]),
                             "sections": tuple(result["config"]["sections"])})
    out: list[Block] = []
    if result.get("memory"):
        out += [f"**Memory per rank** (GPT example {cfg.task_options}, batch {cfg.batch_size}, AdamW, after "
                f"{cfg.memory_steps} steps; largest rank; 'vs 0' = fraction of zero_stage=0 in the same layout). At "
                "DP=1 there is nothing to shard: zero_stage 1 and 2 fall back to the replicated strategy (with a "
                "warning).", [["PP x DP", "zero_stage", "optimizer state KB", "vs 0", "gradients KB (after the step)",
                               "vs 0", "parameters KB", "vs 0"]] +
                [[f"{r['pp']} x {r['dp']}", str(r["stage"]), *(x for k in ("state", "grads", "params")
                  for x in (f"{r[k] / 1e3:.1f}", f"{r[k + '_frac']:.3f}"))] for r in result["memory"]]]
    if result.get("rows"):
        out += [f"**ZeRO++** (PP=2 x DP=2, 1F1B, {cfg.microbatches} microbatches per replica, {cfg.steps} steps, AdamW "
                f"lr {cfg.lr:g}, clip {cfg.clip:g}, one seed). Bytes: ring-model bytes per rank and step, mean of the "
                f"last {cfg.tail} steps; gradient half = reduce-scatter (qgZ: all_to_all), weight half = all-gather; "
                f"'fewer' and the loss (mean of the last {cfg.tail} steps) are against the unquantized run of the same "
                "stage. int8 blocks of 256 with fp32 scales: qgZ rounds stochastically, qwZ to nearest. 'meter = "
                f"dispatch': over steps 1..{cfg.checked_steps} the WireMeter's reduce-scatter / all_to_all / "
                "all-gather bytes equal a c10d dispatch counter's.", zero_pp_table(result["rows"], cfg.tail)]
        same = [r for r in result["rows"] if "same_losses_as_stage0" in r]
        if same:
            out.append("ZeRO-1's losses over all steps are " + ("bit-identical" if same[0]["same_losses_as_stage0"]
                       else "**not** identical") + " to zero_stage=0's.")
    if result.get("profile"):
        one, two = result["profile"]["1"], result["profile"]["2"]
        names = sorted(set(one) | set(two), key=lambda a: one.get(a, 0.0) - two.get(a, 0.0))
        out += ["**Where ZeRO-2's extra CPU time goes** (the speed run under cProfile, rank 0, CPU ms per step by "
                "area; a function of no area is charged to its callers')", [["area", "ZeRO-1 ms/step",
                "ZeRO-2 ms/step", "difference"]] + [[a, f"{x:.1f}", f"{y:.1f}", f"{y - x:+.1f}"] for a, x, y in (
                    (a, *(sum(d.values()) if a == "total" else d.get(a, 0.0) for d in (one, two)))
                    for a in [*names, "total"])]]
    if result.get("speed"):
        out += [f"**Speed** (the same model and layout; zero_stage 0, 1 and 2 built side by side in the same 4 "
                f"processes and stepped in turn, {cfg.speed_warmup} untimed then {cfg.speed_steps} timed steps each, "
                "so all three see the same load; wall: median over steps of the slowest rank; CPU: process time per "
                "step and rank, gloo's threads included; target: ZeRO-2 within 1.2x of ZeRO-1).",
                [["zero_stage", "wall ms/step (median)", "vs ZeRO-1", "CPU ms/step and rank (mean)", "vs ZeRO-1"]] +
                [[str(r["stage"]), f"{r['wall_ms']:.1f}", f"{r['wall_vs_1']:.2f}x", f"{r['cpu_ms']:.1f}",
                  f"{r['cpu_vs_1']:.2f}x"] for r in result["speed"]]]
    return out


def zero_pp_table(rows: list[dict[str, Any]], tail: int) -> Table:
    """Bytes by half, ratios against the same stage's exact run, loss, met/missed, time."""
    out = [["run", "gradient KB/rank/step", "fewer", "weight KB/rank/step", "fewer", f"loss last {tail}", "vs exact",
            "target (>= 3.5x, within 1%)", "ms/step", "meter = dispatch"]]
    for r in rows:
        rel, ratios = r.get("loss_rel"), _quantized_ratios(r)
        met = "-" if rel is None or not ratios else (
            "met" if abs(rel) <= 0.01 and all(f >= 3.5 for f in ratios) else "**missed**")
        out.append([r["label"], f"{r['grad_bytes'] / 1e3:.1f}", _x(r.get("grad_fewer")),
                    f"{r['weight_bytes'] / 1e3:.1f}", _x(r.get("weight_fewer")), f"{r['loss_tail']:.4f}",
                    "-" if rel is None else f"{rel:+.2%}", met,
                    f"{r['step_ms']:.0f}", "yes" if r["checked"] else "**no**"])
    return out


def run(cfg: ZeroBenchConfig) -> Result:
    """The memory table, the speed run, the ZeRO++ runs and their summary (the sections chosen)."""
    runs = run_zero_pp(cfg) if "zero_pp" in cfg.sections else []
    return {"config": asdict(cfg), "memory": memory(cfg) if "memory" in cfg.sections else [],
            "speed": speed_rows(harness.spawn(_speed_worker, cfg, 4, 1800)) if "speed" in cfg.sections else [],
            "runs": runs, "rows": summarize(runs, cfg),
            "profile": harness.spawn(_profile_worker, cfg, 4, 1800)[0] if "profile" in cfg.sections else {}}


PART = Part("zero_bench", "ZeRO", ZeroBenchConfig(), QUICK, run, report, block="zero")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
