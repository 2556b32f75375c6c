"""Part: ZeRO-3 (windows of one and of all stages) against ZeRO-2 and ZeRO-1 on the GPT example, time and memory."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, Table
from duplexpipe import Pipeline, PipelineConfig
from duplexpipe.runtime.memory import optimizer_bytes, storages
from duplexpipe.schedules.shard import episodes, grad_reductions
from duplexpipe.train.pipeline_config import DataParallelConfig, ObserveConfig, SafetyConfig

VARIANTS: tuple[tuple[str, int, int | None], ...] = (
    ("ZeRO-1", 1, None), ("ZeRO-2", 2, None), ("ZeRO-3, window all", 3, None), ("ZeRO-3, window 1", 3, 1))
"""(label, zero_stage, reshard_window) of the runs compared in each case; ZeRO-2 is the baseline of the ratios."""
BASE = "ZeRO-2"
Case = tuple[str, int, int]  # (schedule, PP, DP)


@dataclass(frozen=True)
class Zero3BenchConfig:
    """The GPT example under each of VARIANTS, built side by side in the same processes: timed cases stepped in
    turn (paired steps), memory cases measured only; every case's collectives counted against its episodes."""

    timed: tuple[Case, ...] = (("1f1b", 2, 2), ("zbv", 2, 2))  # (schedule, PP, DP): timed, measured and counted
    measured: tuple[Case, ...] = (("zbv", 2, 4), ("1f1b", 1, 4), ("dualpipev", 2, 2))  # measured, counted only
    steps: int = 40  # timed rounds (each variant one step per round, the first one rotating)
    warmup: int = 5  # untimed rounds first
    memory_steps: int = 3  # steps of the measured pipelines (memory of the last; collectives of all, per step)
    microbatches: int = 4  # microbatches per step and replica
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})  # gpt_task options
    batch_size: int = 32  # global batch (sequences per step, split over the data-parallel replicas)
    lr: float = 3e-3  # AdamW learning rate
    clip: float = 1.0  # global gradient-norm clip


QUICK = Zero3BenchConfig(timed=(("zbv", 2, 2),), measured=(), steps=2, warmup=1, memory_steps=2,
                         task_options={"n_layer": 4, "d_model": 32})


def pipeline(cfg: Zero3BenchConfig, case: Case, stage: int, window: int | None, measure: bool) -> Pipeline:
    """The GPT example's Pipeline for one case and variant (measuring its memory or not)."""
    schedule, pp, dp = case
    pcfg = PipelineConfig(schedule, cfg.microbatches, grad_clip_norm=cfg.clip,
                          data_parallel=DataParallelConfig(zero_stage=stage, reshard_window=window),
                          safety=SafetyConfig(check_inputs_every_step=False),
                          observe=ObserveConfig(measure_memory=measure))
    return harness.gpt_pipeline(harness.gpt(**cfg.task_options), pcfg, harness.adamw(cfg.lr), pp, dp)


def at_rest(pipe: Pipeline) -> dict[str, int]:
    """Bytes this rank holds between steps: its stage modules' parameters and gradients, the optimizer state."""
    modules: list[nn.Module] = list(pipe.stage_modules.values())
    params = storages(p for m in modules for p in m.parameters())
    grads = storages(p.grad for m in modules for p in m.parameters())
    return {"params": sum(params.values()), "grads": sum(grads.values()), "optimizer": optimizer_bytes(pipe.optimizer)}


def counted(pipe: Pipeline, steps: int) -> dict[str, Any]:
    """Collectives over `steps` steps: per kind (the WireMeter's calls), and per stage where FSDP2 posts them."""
    comms = getattr(pipe.dp, "comms", None)
    return {"calls": {k: n / steps for k, n in pipe.dp.meter.calls.items()},
            "gathers": {str(s): n for s, n in comms.gathers.items()} if comms is not None else None,
            "scatters": {str(s): n for s, n in comms.scatters.items()} if comms is not None else None,
            "episodes": {str(s): n for s, n in episodes(pipe.runtime.schedule).items() if s in pipe.stage_modules},
            "reductions": {str(s): n for s, n in grad_reductions(pipe.runtime.schedule).items()
                           if s in pipe.stage_modules},
            "stages": sorted(pipe.stage_modules)}


def _worker(rank: int, world: int, job: tuple[Zero3BenchConfig, Case, bool]) -> dict[str, Any]:
    cfg, case, timed = job
    step = harness.gpt_step(harness.gpt(**cfg.task_options), cfg.batch_size)
    out: dict[str, Any] = {}
    measured = [pipeline(cfg, case, stage, window, True) for _, stage, window in VARIANTS]
    harness.RoundRobin(measured, step).run(cfg.memory_steps)
    for (label, _, _), pipe in zip(VARIANTS, measured, strict=True):
        memory = pipe.last.memory if pipe.last is not None else None
        if memory is None:
            raise RuntimeError(f"{label}: no measured memory after the step")
        out[label] = {"memory": {**{k: v for k, v in memory.to_dict().items() if k != "curve"},
                                 "pg_peak": max((p.params + p.grads for p in memory.curve), default=0)},
                      "rest": at_rest(pipe), **counted(pipe, cfg.memory_steps)}
    del measured
    if timed:
        pipes = [pipeline(cfg, case, stage, window, False) for _, stage, window in VARIANTS]
        traces = harness.RoundRobin(pipes, step).run(cfg.steps, cfg.warmup)
        for (label, _, _), trace in zip(VARIANTS, traces, strict=True):
            out[label].update(wall=trace.wall, cpu=trace.cpu)
    return out


def matches_episodes(ranks: list[dict[str, Any]], steps: int) -> bool:
    """Whether, on every rank and stage, the all-gathers are the episodes times the steps and the reduce-scatters
    the REDUCE_GRAD actions times the steps (ZeRO-3's run: one per step, or one per episode with a gradient under a
    window smaller than the rank's stages)."""
    return all(r["gathers"] is not None and r["gathers"] == {s: n * steps for s, n in r["episodes"].items()}
               and r["scatters"] == {s: n * steps for s, n in r["reductions"].items()} for r in ranks)


def rows(case: Case, ranks: list[dict[str, Any]], cfg: Zero3BenchConfig) -> list[dict[str, Any]]:
    """One row per variant: peaks and bytes at rest (the largest rank), their ratios to ZeRO-2 / ZeRO-1,
    collectives per step of one replica against its episodes, the paired step-time ratio to ZeRO-2."""
    schedule, pp, dp = case
    replica = ranks[::dp]  # data-parallel replica 0's pipeline ranks (make_mesh: rank = pp_index * dp + dp_index)
    out = []
    for label, stage, window in VARIANTS:
        per = [r[label] for r in ranks]
        mem = {k: max(p["memory"][k] for p in per)
               for k in ("params_peak", "params_sharded", "grads_peak", "pg_peak", "total_peak")}
        rest = {k: max(p["rest"][k] for p in per) for k in ("params", "grads", "optimizer")}
        calls = [r[label]["calls"] for r in replica]
        row = {"case": f"{schedule} PP={pp} x DP={dp}", "label": label, "stage": stage, "window": window, **mem,
               **{f"rest_{k}": v for k, v in rest.items()},
               "gathers": sum(c.get("all_gather", 0.0) for c in calls),
               "scatters": sum(c.get("reduce_scatter", 0.0) for c in calls),
               "episodes": sum(sum(r[label]["episodes"].values()) for r in replica),
               "most_stages": max(len(p["stages"]) for p in per),
               "matches": matches_episodes(per, cfg.memory_steps) if stage == 3 else None}
        if "wall" in per[0]:
            row["wall_ms"] = 1e3 * statistics.median(per[0]["wall"])
            row["ratio"] = harness.paired_ratio(per[0]["wall"], ranks[0][BASE]["wall"])
            row["cpu_ms"] = 1e3 * statistics.fmean(c for p in per for c in p["cpu"])
        out.append(row)
    base = next(r for r in out if r["label"] == BASE)
    one = next(r for r in out if r["label"] == "ZeRO-1")
    for r in out:
        r["vs2"] = {k: r[k] / base[k] for k in ("params_peak", "grads_peak", "pg_peak", "total_peak")}
        r["rest_params_vs1"] = r["rest_params"] / one["rest_params"]
    return out


def run(cfg: Zero3BenchConfig) -> Result:
    """Each case in its own processes (PP x DP of them): timed cases, then measured ones."""
    out = []
    for case, timed in [*((c, True) for c in cfg.timed), *((c, False) for c in cfg.measured)]:
        ranks = harness.spawn(_worker, (cfg, case, timed), case[1] * case[2], 3600)
        out += rows(case, ranks, cfg)
    return {"config": asdict(cfg), "rows": out}


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f}"


def _ratio(row: dict[str, Any]) -> str:
    if "ratio" not in row:
        return "-"
    mid, lo, hi = row["ratio"]
    return f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"


def table(result_rows: list[dict[str, Any]]) -> Table:
    """Memory, collectives and time per case and variant."""
    out = [["case", "run", "unsharded params peak KB", "vs ZeRO-2", "param shards KB", "grads peak KB",
            "params+grads peak KB", "vs ZeRO-2",
            "total peak KB", "vs ZeRO-2", "params at rest KB", "vs ZeRO-1", "all-gathers / step", "reduce-scatters "
            "/ step", "episodes / step", "counted = episodes", "step ms (median)", "step vs ZeRO-2 (95% CI)"]]
    for r in result_rows:
        label = r["label"] + (" (= all: one stage per rank)" if r["window"] == 1 and r["most_stages"] == 1 else "")
        out.append([r["case"], label, _kb(r["params_peak"]), f"{r['vs2']['params_peak']:.2f}",
                    _kb(r["params_sharded"]), _kb(r["grads_peak"]), _kb(r["pg_peak"]), f"{r['vs2']['pg_peak']:.2f}",
                    _kb(r["total_peak"]), f"{r['vs2']['total_peak']:.2f}", _kb(r["rest_params"]),
                    f"{r['rest_params_vs1']:.2f}",
                    f"{r['gathers']:g}", f"{r['scatters']:g}", f"{r['episodes']:g}" if r["stage"] == 3 else "-",
                    "-" if r["matches"] is None else "yes" if r["matches"] else "**no**",
                    f"{r['wall_ms']:.0f}" if "wall_ms" in r else "-", _ratio(r)])
    return out


def report(result: Result) -> list[Block]:
    """The one table and what it measured."""
    cfg = Zero3BenchConfig(**{**result["config"], **{k: tuple(tuple(c) for c in result["config"][k])
                                                     for k in ("timed", "measured")}})
    saving = [r for r in result["rows"] if r["label"] == "ZeRO-3, window 1" and r["most_stages"] > 1]
    out: list[Block] = [
        f"**ZeRO-3 against ZeRO-2 and ZeRO-1** (GPT example {cfg.task_options}, AdamW, {cfg.microbatches} "
        f"microbatches per replica, batch {cfg.batch_size}, float32, gloo on CPU). Memory: `pipe.last.memory` of "
        f"step {cfg.memory_steps} (measured from the tensors each rank holds at every action boundary; the largest "
        "rank): the peak of unsharded parameters (what the residency window bounds; FSDP2 pads each parameter's dim "
        "0 to a multiple of DP), FSDP2's parameter shards (held throughout, 1/DP), the unreduced and reduced "
        "gradients, the peak of parameters (unsharded and shards) + gradients held at once, and the total "
        "(parameters, gradients, activations, messages and optimizer state); bytes at rest after the step "
        "(ZeRO-1's parameters are replicated, as zero_stage=0's). Collectives: calls per step summed over one "
        f"data-parallel replica's pipeline ranks (the WireMeter, over {cfg.memory_steps} steps); 'counted = "
        "episodes': on every rank and stage the FSDP2 all-gathers equal the schedule's residency episodes (the "
        "UNSHARD actions of the ZeRO-3 pass) times the steps, and the reduce-scatters its REDUCE_GRAD actions "
        "times the steps (one per stage per step; with window 1 on two stages per rank one per episode with a "
        "gradient, windowed gradients). Time (timed "
        f"cases only): the four variants built in the same processes and stepped in turn, {cfg.warmup} untimed then "
        f"{cfg.steps} timed rounds, the first variant rotating; step = the slowest rank's wall; 'vs ZeRO-2' = the "
        "median over rounds of this variant's step / ZeRO-2's step of the same round, with a bootstrap interval.",
        table(result["rows"])]
    if saving:
        out.append("Window 1 against ZeRO-2, peak parameter + gradient bytes: " + "; ".join(
            f"{r['case']}: {1 - r['vs2']['pg_peak']:.0%} less (unsharded parameters alone "
            f"{1 - r['vs2']['params_peak']:.0%})"
            for r in saving) + ".")
    return out


PART = Part("zero3_bench", "ZeRO-3 under pipeline parallelism", Zero3BenchConfig(), QUICK, run, report,
            block="zero3")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
