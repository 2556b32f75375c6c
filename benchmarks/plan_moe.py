"""Part: `duplexpipe plan` on a calibrated profile of an MoE language model against its top candidates trained."""

from __future__ import annotations

import copy
import itertools
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks import harness, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result, mark, ms
from duplexpipe import Pipeline, PipelineConfig, PlanConfig, Profile, build_schedule, plan
from duplexpipe.launch.profiling import ProfileRequest, profile_calibrated, task_parts
from duplexpipe.launch.train_config import TrainConfig
from duplexpipe.launch.train_task import build_task
from duplexpipe.planner.calibrate import FIT_ERROR, with_calibration
from duplexpipe.sizes import parse_bytes

TASK = "benchmarks.models:moe_lm_task"
TIE = 0.02
"""Candidates predicted less than this fraction apart, or less than the model's miss on its own calibration runs
(`fit_error`) where that is larger, are predicted equal: their measured ratio is expected within its noise (a 95%
interval that holds 1), not in an order."""


@dataclass(frozen=True)
class PlanMoEConfig:
    """What `duplexpipe profile --task benchmarks.models:moe_lm_task --parts PARTS --calibrate --ranks P --batch B`
    and `duplexpipe plan -p P --batch B --memory MEMORY --schedules ...` do, then the plan's first `top` candidates
    trained round-robin in the same P gloo processes."""

    ranks: int = 4  # pipeline ranks (gloo processes), of the calibration and of the plan
    parts: int = 8  # profiled model parts (2P: interleaved and V schedules can be planned)
    batch: int = 32  # samples per step (32 characters each)
    memory: str = "1GiB"  # the plan's cap per rank
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev")
    """The schedules planned (every built-in; `auto` is left out: its schedule is searched per M)."""
    top: int = 4  # candidates trained: the plan's first `top` rows
    steps: int = 20  # measured steps of every candidate
    warmup: int = 2  # unmeasured steps of every candidate first
    budget_s: float = 3.0  # the calibration's measured seconds (duplexpipe profile --budget)
    task: tuple[tuple[str, int], ...] = ()  # keyword arguments of the task (dim, layers, experts, seq)


QUICK = PlanMoEConfig(ranks=2, parts=4, batch=8, schedules=("gpipe", "1f1b", "interleaved-1f1b"), top=2, steps=2,
                      warmup=1, budget_s=0.5, task=(("dim", 16), ("layers", 4), ("experts", 4), ("seq", 8)))


def _plan_config(cfg: PlanMoEConfig, **fields: Any) -> PlanConfig:
    return PlanConfig(ranks=cfg.ranks, batch=cfg.batch, memory=parse_bytes(cfg.memory), schedules=cfg.schedules,
                      **fields)


def predictions(profile: Profile, cfg: PlanMoEConfig) -> dict[str, Any]:
    """The plan as `duplexpipe plan` makes it from the calibrated profile ("plan": the calibration's cores, the share
    of them its runs got, the wall scale), and two comparisons: the calibration's cores without that share ("cores"),
    a device per rank ("device")."""
    whole = with_calibration(profile, _plan_config(cfg))
    mesh = dict(profile.meta.get("calibration_mesh") or {})
    cores = mesh.get("cores")
    unfitted = replace(profile, meta={k: v for k, v in profile.meta.items() if k != "calibration_mesh"})
    out: dict[str, Any] = {}
    variants = (("plan", whole), ("cores", with_calibration(unfitted, _plan_config(cfg, cores=cores))),
                ("device", with_calibration(unfitted, _plan_config(cfg))))
    for key, (prof, config, note) in variants:
        result = plan(prof, config)
        out[key] = {"note": note, "cores": config.cores, "fit_error": prof.meta.get(FIT_ERROR, 0.0),
                    "rows": [r.to_dict() for r in result.rows if r.feasible]}
    return out


def _schedule(label: str, ranks: int, m: int) -> Any:
    """The schedule of a plan row's label ("interleaved-1f1b(chunks=2)" and the like)."""
    name, _, rest = label.partition("(")
    options = {k: int(v) for k, v in (item.split("=") for item in rest.rstrip(")").split(",") if item)}
    return build_schedule(name, ranks, m, **options)


def _worker(rank: int, world: int, arg: tuple[PlanMoEConfig, list[dict[str, Any]]]) -> dict[str, Any]:
    cfg, rows = arg
    task = build_task(TrainConfig(task=TASK, task_options=dict(cfg.task)))
    parts, _, loss = task_parts(task, cfg.parts, "uniform")
    x, y = task.batch(0, cfg.batch)
    pipes = []
    for row in rows:
        schedule = _schedule(row["schedule"], world, row["microbatches"])
        merged = deep.merge_parts(copy.deepcopy(parts), row["groups"])
        pipes.append(Pipeline(merged, loss, harness.adamw(), PipelineConfig(schedule=schedule, grad_clip_norm=1.0)))
    traces = harness.RoundRobin(pipes, lambda p, _: p.step(x, y)).run(cfg.steps, cfg.warmup)
    return {"wall": [t.wall for t in traces], "cpu": [sorted(t.cpu)[len(t.cpu) // 2] for t in traces]}


def _groups(profile: Profile, row: dict[str, Any], ranks: int) -> list[int]:
    schedule = _schedule(row["schedule"], ranks, row["microbatches"])
    return list(profile.group_sizes(schedule.num_groups))


def run(cfg: PlanMoEConfig) -> Result:
    """Profile and calibrate (as `duplexpipe profile --calibrate`), plan, train the first `top` rows round-robin."""
    request = ProfileRequest(TASK, dict(cfg.task), cfg.parts, calibrate=True, ranks=cfg.ranks, batch=cfg.batch,
                             budget_s=cfg.budget_s)
    before = harness.uptime()
    profile = profile_calibrated(request)
    predicted = predictions(profile, cfg)
    chosen = [dict(r, groups=_groups(profile, r, cfg.ranks)) for r in predicted["plan"]["rows"][:cfg.top]]
    measured = harness.spawn(_worker, (cfg, chosen), cfg.ranks, 1800)
    rows = []
    for k, row in enumerate(chosen):
        step = harness.summarize(measured[0]["wall"][k])
        key = (row["schedule"], row["microbatches"])
        others = {name: next((r["step_s"] for r in v["rows"] if (r["schedule"], r["microbatches"]) == key), None)
                  for name, v in predicted.items() if name != "plan"}
        rows.append({"candidate": f"{row['schedule']}, M={row['microbatches']}", "groups": row["groups"],
                     "predicted_s": row["step_s"], "others": others, "measured": step.to_dict(),
                     "walls_s": measured[0]["wall"][k],
                     "cpu_s": [r["cpu"][k] for r in measured]})
    tie = max(TIE, predicted["plan"]["fit_error"])
    return {"rows": rows, "pairs": pairs(rows, tie), "tie": tie, "config": asdict(cfg), "uptime_profile": before,
            "notes": {k: v["note"] for k, v in predicted.items()},
            "cores": {k: v["cores"] for k, v in predicted.items()},
            "overhead": profile.overhead.to_dict() if profile.overhead else None,
            "calibration_walls": profile.meta.get("calibration_walls"), "machine_cores": os.cpu_count(),
            "calibration_samples": profile.meta.get("calibration_samples"), "uptime_after": harness.uptime()}


def pairs(rows: list[dict[str, Any]], tie: float = TIE) -> list[dict[str, Any]]:
    """Each pair of candidates in the plan's order: the predicted gap, the measured one (the median over rounds of
    the second's step over the first's, stepped side by side) with its 95% bootstrap interval, whether it is in the
    plan's order, whether the two are apart beyond their noise (the interval does not hold 1), and the verdict:
    "in order", "tie held" (predicted less than `tie` apart, measured within noise), "within noise" (out of order,
    or apart where a tie was predicted, inside the noise), or "reversed" (out of order beyond the noise)."""
    out = []
    for a, b in itertools.combinations(rows, 2):
        ratio, low, high = harness.paired_ratio(b["walls_s"], a["walls_s"])
        apart = low > 1.0 or high < 1.0
        gap = b["predicted_s"] / a["predicted_s"] - 1
        ordered = ratio >= 1.0
        if gap < tie:
            verdict = "within noise" if apart else "tie held"
        else:
            verdict = "in order" if ordered else "reversed" if apart else "within noise"
        out.append({"faster": a["candidate"], "slower": b["candidate"], "predicted_gap": gap,
                    "measured_gap": ratio - 1, "interval": (low - 1, high - 1), "same_order": ordered,
                    "apart": apart, "verdict": verdict})
    return out


def verdict(pairs_: list[dict[str, Any]]) -> str:
    """The whole order: "holds" (every pair in order or a tie held), "within noise" (no pair reversed beyond its
    noise), or "reversed"."""
    found = {p["verdict"] for p in pairs_}
    if "reversed" in found:
        return "reversed"
    return "within noise" if "within noise" in found else "holds"


def report(part: Result) -> list[Block]:
    """How it was measured, predicted vs measured per candidate, the pairs."""
    cfg, o = part["config"], part["overhead"] or {}
    model = dict(cfg["task"]) or ("dim 64, 8 blocks of attention + MoE with 8 experts, top-2, a shared expert, sigmoid "
                                  "router, seq 32")
    intro = (f"A small MoE language model (`{TASK}`, {model}), {cfg['parts']} parts, profiled "
             f"and calibrated as `duplexpipe profile --calibrate --ranks {cfg['ranks']} --batch {cfg['batch']}` does "
             f"(calibration: {o.get('method', 'none')}; compute x {o.get('compute_scale', 1):.3g}, "
             f"{o.get('action_s', 0) * 1e6:.0f} us per action, {o.get('message_s', 0) * 1e6:.0f} us per message, "
             f"{o.get('step_s', 0) * 1e3:.3g} ms per step), then planned as `duplexpipe plan -p {cfg['ranks']} "
             f"--batch {cfg['batch']} --memory {cfg['memory']}` over {', '.join(cfg['schedules'])} "
             f"({part['notes']['plan']}); "
             f"the plan's first {cfg['top']} candidates trained round-robin in the same {cfg['ranks']} gloo processes, "
             f"{cfg['warmup']} warm-up + {cfg['steps']} measured steps each (a step: the slowest rank's wall time "
             "between barriers). Comparisons: the calibration's cores without the fitted share ('cores'), a device "
             "per rank ('device').")
    table = [["candidate", "parts per stage", "predicted ms", "measured ms (median)", "IQR", "error",
              "'cores' ms", "'device' ms", "CPU ms (all ranks)"]] + [
        [r["candidate"], "/".join(map(str, r["groups"])), ms(r["predicted_s"]), ms(r["measured"]["median_s"]),
         f"{ms(r['measured']['q1_s'])}-{ms(r['measured']['q3_s'])}",
         f"{r['measured']['median_s'] / r['predicted_s'] - 1:+.0%}",
         *(ms(r["others"][k]) if r["others"].get(k) else "-" for k in ("cores", "device")), ms(sum(r["cpu_s"]))]
        for r in part["rows"]]
    order = [["predicted first", "predicted second", "predicted gap", "measured gap (paired)", "95% interval",
              "same order", "apart", "verdict"]] + [
        [p["faster"], p["slower"], f"{p['predicted_gap']:+.1%}", f"{p['measured_gap']:+.1%}",
         f"{p['interval'][0]:+.1%} to {p['interval'][1]:+.1%}", mark(p["same_order"]), "yes" if p["apart"] else "no",
         p["verdict"]] for p in part["pairs"]]
    walls = ", ".join(f"{n} M={m} {w * 1e3:.0f} ms" for n, m, w in part.get("calibration_walls") or [])
    tie = part.get("tie", TIE)
    return [intro, table, order, f"The measured order of the first {cfg['top']}: {verdict(part['pairs'])} (pairs "
            f"predicted less than {tie:.1%} apart count as predicted equal: the model's miss on its own calibration "
            f"runs, at least {TIE:.0%}). Calibration runs' walls: {walls}."]


PART = Part("plan_moe", "The planner's order on a calibrated MoE model vs measurement", PlanMoEConfig(), QUICK, run,
            report, block="plan-moe")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
