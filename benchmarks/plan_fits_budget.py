"""Part: schedule="auto" under a memory limit that only a memory lever meets, against every manual plan that fits."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.framework import Block, Part, Result, mark, met
from benchmarks.runner import main
from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.train.pipeline_config import DataParallelConfig, ObserveConfig, SafetyConfig

STEP_TARGET = 1.05
"""The planner's plan at most this times the step of the fastest manual plan that fits (paired rounds)."""
Manual = tuple[str, bool | str, int, int | None]
"""(schedule, activation_checkpointing (False, "selective" or True), ZeRO stage, reshard window) of a manual plan."""


@dataclass(frozen=True)
class BudgetBenchConfig:
    """The GPT example on PP x DP CPU processes. Every manual plan of the grid is built and its memory measured; the
    limit is `limit_fraction` of the smallest peak of the plans without a memory lever (no checkpointing, ZeRO 0),
    so only a lever fits. schedule="auto" plans under that limit (compression fixed to none, as in the grid); its
    pipeline and every manual plan that fits are then stepped in turn, round by round."""

    schedules: tuple[str, ...] = ("1f1b", "zb-h1", "interleaved-1f1b", "zbv")
    zero: tuple[tuple[int, int | None], ...] = ((0, None), (1, None), (2, None), (3, 1))  # (stage, window)
    checkpointing: tuple[bool | str, ...] = (False, "selective", True)  # the policies of the manual grid
    pp: int = 2
    dp: int = 2
    microbatches: int = 8
    n_layer: int = 8
    d_model: int = 64
    batch_size: int = 32
    limit_fraction: float = 0.85
    memory_steps: int = 2
    rounds: int = 10
    warmup: int = 2
    calibrate: bool = True  # the planner's in-pipeline calibration of the runtime's work (False: its defaults)


QUICK = BudgetBenchConfig(schedules=("1f1b", "zbv"), zero=((0, None), (1, None)), checkpointing=(False, True),
                          microbatches=4, n_layer=4, d_model=32, batch_size=16, rounds=2, warmup=1, calibrate=False)


def _config(cfg: BudgetBenchConfig, plan: Manual | None, limit: int | None, measure: bool) -> PipelineConfig:
    observe = ObserveConfig(record_timeline=False, measure_memory=measure)
    safety = SafetyConfig(check_inputs_every_step=False)
    if plan is None:
        return PipelineConfig("auto", memory_limit=limit, grad_clip_norm=1.0, observe=observe, safety=safety,
                              data_parallel=DataParallelConfig(grad_compression="none"),
                              schedule_options={"schedules": list(cfg.schedules), "calibration_cache": None,
                                                "calibrate": cfg.calibrate})
    schedule, ckpt, stage, window = plan
    return PipelineConfig(schedule, cfg.microbatches, grad_clip_norm=1.0, activation_checkpointing=ckpt,
                          observe=observe, safety=safety,
                          data_parallel=DataParallelConfig(zero_stage=stage, reshard_window=window))


def _build(cfg: BudgetBenchConfig, plan: Manual | None, limit: int | None = None, measure: bool = True) -> Pipeline:
    task = harness.gpt(cfg.n_layer, cfg.d_model)
    if plan is None:
        x, y = task.batch(0, cfg.batch_size)
        share = cfg.batch_size // cfg.dp  # the sample is one replica's batch, as each replica's `step` gets it
        return Pipeline.from_layers(task.layers, task.loss_fn, harness.adamw(), _config(cfg, None, limit, measure),
                                    embedding=task.embedding, head=task.head, mesh=make_mesh(cfg.pp, cfg.dp),
                                    sample_input=x[:share], sample_targets=y[:share])
    return harness.gpt_pipeline(task, _config(cfg, plan, limit, measure), harness.adamw(), cfg.pp, cfg.dp)


def _peak(pipe: Pipeline, step: Any, steps: int) -> int:
    """The largest rank's measured peak of everything held over the last of `steps` steps."""
    for i in range(steps):
        step(pipe, i)
    assert pipe.last is not None and pipe.last.memory is not None
    peak = torch.tensor([pipe.last.memory.total_peak], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def grid(cfg: BudgetBenchConfig) -> list[Manual]:
    """Every manual plan: schedule x checkpointing x ZeRO."""
    return [(s, ckpt, stage, window) for s in cfg.schedules for ckpt in cfg.checkpointing
            for stage, window in cfg.zero]


def worker(rank: int, world: int, cfg: BudgetBenchConfig) -> dict[str, Any]:
    """Measure every manual plan's peak, set the limit, plan under it, then time the plan and the manual plans that
    fit in turn."""
    task = harness.gpt(cfg.n_layer, cfg.d_model)
    step = harness.gpt_step(task, cfg.batch_size)
    peaks = {plan: _peak(_build(cfg, plan), step, cfg.memory_steps) for plan in grid(cfg)}
    plain = min(p for (_, ckpt, stage, _), p in peaks.items() if ckpt is False and stage == 0)
    limit = int(cfg.limit_fraction * plain)
    auto = _build(cfg, None, limit)
    assert auto.auto is not None
    auto_peak = _peak(auto, step, cfg.memory_steps)
    fits = [plan for plan, p in peaks.items() if p <= limit]
    timed = [auto] + [_build(cfg, plan, measure=False) for plan in fits]
    traces = harness.RoundRobin(timed, step).run(cfg.rounds, cfg.warmup)
    return {"peaks": [[list(plan), p] for plan, p in peaks.items()], "limit": limit, "plain": plain,
            "auto": {"plan": auto.plan.summary(), "peak": auto_peak, "predicted": auto.auto.result.best.peak_bytes,
                     "decided": auto.auto.result.decided},
            "fits": [list(plan) for plan in fits], "wall": [t.wall for t in traces]}


def run(cfg: BudgetBenchConfig) -> Result:
    """The whole comparison on PP x DP processes (rank 0's record: limits and peaks agree on every rank)."""
    lead = harness.spawn(worker, cfg, cfg.pp * cfg.dp, 3600.0)[0]
    return {"config": asdict(cfg), **lead}


POLICY: dict[Any, str] = {False: "off", "selective": "selective", True: "full"}
"""How the report names a manual plan's checkpointing."""


def label(plan: list[Any]) -> str:
    schedule, ckpt, stage, window = plan
    zero = f"ZeRO {stage}" + (f"/w{window}" if window else "")
    return f"{schedule}, {zero}" + {False: "", "selective": ", selectively checkpointed"}.get(ckpt, ", checkpointed")


def ratios(result: Result) -> list[float]:
    """Per manual plan that fits: the planner's step over its step, the median of paired rounds."""
    auto, *manual = result["wall"]
    return [statistics.median(a / m for a, m in zip(auto, times, strict=True)) for times in manual]


def report(result: Result) -> list[Block]:
    """The limit, the planner's plan (fits?), each manual plan that fits with the paired ratio, the verdict."""
    cfg, auto = result["config"], result["auto"]
    kib = 1024.0
    ms = [1e3 * statistics.median(w) for w in result["wall"]]
    table = [["plan", "measured peak KiB", "fits", "step ms (median)", "planner / this"]]
    table.append([f"planner: {auto['plan']}", f"{auto['peak'] / kib:.0f}", mark(auto["peak"] <= result["limit"]),
                  f"{ms[0]:.1f}", "1.00"])
    peaks = {tuple(p): v for p, v in result["peaks"]}
    paired = ratios(result)
    for plan, step, ratio in zip(result["fits"], ms[1:], paired, strict=True):
        table.append([label(plan), f"{peaks[tuple(plan)] / kib:.0f}", "yes", f"{step:.1f}", f"{ratio:.2f}"])
    best = max(paired, default=float("nan"))  # the planner against the fastest manual plan: its largest ratio
    fits = auto["peak"] <= result["limit"]
    return [
        f"The GPT example ({cfg['n_layer']} blocks, width {cfg['d_model']}, AdamW) on PP={cfg['pp']} x DP={cfg['dp']} "
        f"CPU processes (gloo), {cfg['batch_size']} sequences a step; manual grid: {', '.join(cfg['schedules'])} x "
        f"checkpointing {'/'.join(POLICY[c] for c in cfg['checkpointing'])} x "
        f"ZeRO {', '.join(str(z) for z, _ in cfg['zero'])}, M={cfg['microbatches']}. "
        f"Limit: {cfg['limit_fraction']:.0%} of the smallest plan without a lever ({result['plain'] / kib:.0f} KiB) = "
        f"{result['limit'] / kib:.0f} KiB per rank; {len(result['fits'])} of {len(result['peaks'])} manual plans fit "
        f"(measured). The planner predicted {auto['predicted'] / kib:.0f} KiB for its plan; it says: {auto['decided']}",
        table,
        f"The planner's plan fits (measured): {met(fits)} (measured {auto['peak'] / auto['predicted']:.2f}x its "
        f"prediction). Its step is {best:.2f}x the fastest manual plan that fits "
        f"(median of paired rounds; target: a plan that fits, at most {STEP_TARGET:g}x: "
        f"{met(fits and best <= STEP_TARGET)})."]


PART: Part[BudgetBenchConfig] = Part(
    name="plan_fits_budget", title="Planning under a memory limit against the manual plans that fit",
    config=BudgetBenchConfig(), quick=QUICK, run=run, report=report)

if __name__ == "__main__":
    raise SystemExit(main(only="plan_fits_budget"))
