"""Part: the planner's choice among the P x D x T meshes of world 4 against measured runs of the GPT example."""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result, figure, mark, ms
from benchmarks.measure_overhead import measure_overhead
from benchmarks.plan_vs_measured import _measure_link as measure_link
from duplexpipe import Pipeline, PipelineConfig, PlanConfig, Profile, make_mesh, plan_partition, profile_parts
from duplexpipe.launch.tasks.gpt import gpt_tp_plan
from duplexpipe.train.pipeline_config import ObserveConfig, SafetyConfig

NO_LIMIT = 2**62  # no memory cap
WORLD = 4
FIGURE = "plan_tp.png"


@dataclass(frozen=True)
class PlanTPConfig:
    """The GPT example profiled whole with its TP plan, every P x D x T = 4 planned (1F1B at a fixed M, so the
    meshes are what differs), and each mesh trained round-robin in the same 4 gloo processes."""

    n_layer: int = 4  # GPT blocks (4 profiled parts of one block each, embedding and head in the first and last)
    d_model: int = 256  # GPT width (TP divides the blocks' matrices; the task's 4 heads allow TP 2 and 4)
    batch: int = 16  # sequences per step (split over D replicas, then into M microbatches)
    microbatches: int = 4  # M of every mesh (1F1B)
    meshes: tuple[tuple[int, int, int], ...] = ((4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4))
    """(P, D, T) trained and measured (world 4's factorisations)."""
    steps: int = 12  # measured steps of every mesh
    warmup: int = 2  # unmeasured steps of every mesh first
    profile_repeats: int = 5  # profile_parts repeats (the fastest is kept)
    overhead_steps: int = 10  # steps of each run of the runtime-overhead calibration (1-weight parts)


QUICK = PlanTPConfig(n_layer=4, d_model=32, batch=8, microbatches=2, meshes=((4, 1, 1), (2, 1, 2)), steps=2,
                     warmup=1, profile_repeats=1, overhead_steps=2)


def _from_rank0(value: Any) -> Any:
    payload = [value]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _profile(parts: list[nn.Module], task: Any, cfg: PlanTPConfig) -> Profile:
    """Rank 0's profile of the whole parts with the TP plan's facts, affine between the largest microbatch (D = 1)
    and the smallest (D = 4), the other ranks waiting."""
    x, y = task.batch(0, cfg.batch)
    rows = cfg.batch // cfg.microbatches
    small = max(1, rows // 4)
    found = None
    if dist.get_rank() == 0:
        found = profile_parts(copy.deepcopy(parts), x[:rows], target=y[:rows], loss_fn=task.loss_fn,
                              repeats=cfg.profile_repeats, warmup=1, fit_rows=small if small < rows else 0,
                              evict_bytes=deep.cache_evict_bytes(), tp_plan=gpt_tp_plan(False)).to_dict()
    return Profile.from_dict(_from_rank0(found))


def _links(profile: Profile, cfg: PlanTPConfig, cores: int) -> dict[str, Any]:
    """The stage-to-stage link (round trips between ranks 0 and 1), the all-reduce link of two ranks (over the TP
    groups of a 2 x TP 2 mesh, all at once, between barriers), the latter also for the data-parallel reduction (the
    same loopback), and the TP link under the machine's sharing: each collective's partner wait measured with every
    rank computing between collectives (`tp_collective_work`, the compute a block's forward does per collective on
    one of 2 TP ranks), as the latency of its 2(T-1) messages where that is more."""
    rows = cfg.batch // cfg.microbatches
    at = profile.at_microbatch(rows)
    message = max(p.output_bytes for p in at.parts[:-1])
    groups = deep.ParallelGroups.from_mesh(make_mesh(2, tp=2))
    latency, bandwidth = deep.measure_tp_link(groups.tp_group, int(message))
    block = at.parts[min(1, len(at.parts) - 1)]
    collectives = block.tp.forward_collectives if block.tp is not None else 1
    busy = block.forward_s / 2 / max(1, collectives)
    work = deep.tp_collective_work(groups.tp_group, 4, busy, cores)
    return {"p2p": measure_link(int(message)), "tp": deep.Link(bandwidth, max(latency, work / 2)),
            "tp_barrier": deep.Link(bandwidth, latency), "dp": deep.Link(bandwidth, latency),
            "tp_work_s": work, "tp_busy_s": busy}


def _predictions(profile: Profile, links: dict[str, Any], cfg: PlanTPConfig, cores: int) -> dict[str, Any]:
    """The planner's rows for world 4 (1F1B at M, no ZeRO or compression): the model (the TP link with the partner
    wait), the TP link measured between barriers, and the model without the runtime's work."""
    config = PlanConfig(ranks=1, batch=cfg.batch, memory=NO_LIMIT, schedules=("1f1b",),
                        microbatches=(cfg.microbatches,), zero_stages=(0,), compressions=("none",),
                        p2p_link=links["p2p"], dp_link=links["dp"], tp_link=links["tp"], cores=cores)
    out = {}
    for key, prof, tp_link in (("model", profile, links["tp"]), ("barrier_link", profile, links["tp_barrier"]),
                               ("no_overhead", replace(profile, overhead=None), links["tp"])):
        result = deep.plan_world(prof, replace(config, tp_link=tp_link), WORLD)
        out[key] = {"best": result.best.mesh, "rows": {r.mesh: r.to_dict() for r in result.rows}}
    return out


def _worker(rank: int, world: int, cfg: PlanTPConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    task = harness.gpt(cfg.n_layer, cfg.d_model)
    partition = plan_partition(task.layers, cfg.n_layer, "uniform", embedding=task.embedding, head=task.head)
    parts: list[nn.Module] = list(deep.build_parts(task.layers, partition, embedding=task.embedding, head=task.head))
    profile = _profile(parts, task, cfg)
    cores = len(os.sched_getaffinity(0))
    links = _links(profile, cfg, cores)
    with torch.no_grad():
        message = torch.zeros_like(parts[0](task.batch(0, cfg.batch // cfg.microbatches)[0]))
    overhead = measure_overhead(message, steps=cfg.overhead_steps, config=_run_config(cfg)).overhead
    predicted = _predictions(replace(profile, overhead=overhead), links, cfg, cores)
    pipes = [Pipeline.from_layers(task.layers, task.loss_fn, harness.adamw(), _run_config(cfg),
                                  embedding=task.embedding, head=task.head, mesh=make_mesh(p, d, tp=t),
                                  tp_plan=gpt_tp_plan() if t > 1 else None) for p, d, t in cfg.meshes]
    started = time.monotonic()
    traces = harness.RoundRobin(pipes, harness.gpt_step(task, cfg.batch)).run(cfg.steps, cfg.warmup)
    out: dict[str, Any] = {"seconds": [t.wall for t in traces], "cpu": [statistics.median(t.cpu) for t in traces],
                           "param_bytes": [p.param_bytes for p in pipes], "run_s": time.monotonic() - started}
    if rank == 0:
        out.update(predicted=predicted, profile=profile.to_dict(), overhead=overhead.to_dict(), cores=cores,
                   links={k: {"latency_s": v.latency, "bandwidth": v.bandwidth} for k, v in links.items()
                          if isinstance(v, deep.Link)}, tp_work_s=links["tp_work_s"], tp_busy_s=links["tp_busy_s"])
    return out


def _run_config(cfg: PlanTPConfig) -> PipelineConfig:
    """Every measured pipeline's settings: 1F1B at the config's M."""
    return PipelineConfig(schedule="1f1b", num_microbatches=cfg.microbatches,
                          observe=ObserveConfig(record_timeline=False),
                          safety=SafetyConfig(check_inputs_every_step=False))


def summarize(per_rank: list[dict[str, Any]], cfg: PlanTPConfig) -> list[dict[str, Any]]:
    """One row per measured mesh: predicted (both models) vs measured step time, and the ranks of each."""
    lead = per_rank[0]
    rows = []
    for k, (p, d, t) in enumerate(cfg.meshes):
        mesh = f"{p}x{d}x{t}"
        step = harness.summarize(lead["seconds"][k])
        predicted = {key: lead["predicted"][key]["rows"][mesh] for key in ("model", "barrier_link")}
        rows.append({"mesh": mesh, "measured": step.to_dict(), "min_s": min(lead["seconds"][k]),
                     "max_s": max(lead["seconds"][k]), "samples": lead["seconds"][k],
                     "predicted_s": predicted["model"]["step_s"], "barrier_s": predicted["barrier_link"]["step_s"],
                     "predicted_peak": predicted["model"]["peak_bytes"],
                     "param_bytes": [r["param_bytes"][k] for r in per_rank]})
    for key, field in (("measured_rank", lambda r: r["measured"]["median_s"]), ("predicted_rank",
                                                                               lambda r: r["predicted_s"]),
                       ("barrier_rank", lambda r: r["barrier_s"])):
        for place, row in enumerate(sorted(rows, key=field), 1):
            row[key] = place
    return rows


def run(cfg: PlanTPConfig) -> Result:
    """Measure; the rows, the planner's first choice (among all of world 4's meshes) and whether it was measured
    fastest."""
    per_rank = harness.spawn(_worker, cfg, WORLD, 3600)
    rows, lead = summarize(per_rank, cfg), per_rank[0]
    best_measured = min(rows, key=lambda r: r["measured"]["median_s"])["mesh"]
    return {"rows": rows, "config": asdict(cfg), "best_measured": best_measured,
            **{f"best_{k}": lead["predicted"][k]["best"] for k in ("model", "barrier_link")},
            "all_predicted": {k: {m: r["step_s"] for m, r in v["rows"].items()} for k, v in lead["predicted"].items()},
            **{k: lead.get(k) for k in ("profile", "overhead", "cores", "links", "tp_work_s", "tp_busy_s")}}


def report(part: Result) -> list[Block]:
    """How it was measured, the table, and the verdict."""
    cfg, links, o = part["config"], part["links"], part["overhead"]
    facts = part["profile"]["parts"][1].get("tp", {})
    intro = (f"GPT example (n_layer {cfg['n_layer']}, d_model {cfg['d_model']}, 4 heads, batch "
             f"{cfg['batch']} x 64 characters, 1F1B with M={cfg['microbatches']}, AdamW) on "
             f"{WORLD} gloo processes sharing {part['cores']} cores; every P x D x T mesh trained in the same "
             f"processes, {cfg['warmup']} warm-up + {cfg['steps']} measured steps each, round-robin. The planner "
             f"(`plan_world`, what `duplexpipe plan --world 4` runs): rank 0's profile of the 4 whole parts with "
             f"the bundled TP plan's facts (a block: {facts.get('forward_collectives')} collectives forward, "
             f"{facts.get('backward_collectives')} backward), {part['cores']} cores shared by the world, the "
             f"measured links (stage to stage: {links['p2p']['latency_s'] * 1e6:.0f} us per message, "
             f"{links['p2p']['bandwidth'] / 1e6:,.0f} MB/s; a 2-rank all-reduce between barriers, for DP and the "
             f"'TP link between barriers' comparison: {links['dp']['latency_s'] * 1e6:.0f} us per message, "
             f"{links['dp']['bandwidth'] / 1e6:,.0f} MB/s; the TP link under the machine's sharing: "
             f"{(part.get('tp_work_s') or 0) * 1e6:.0f} us of core work per collective, measured with every rank "
             f"computing {(part.get('tp_busy_s') or 0) * 1e3:.2f} ms between collectives (`tp_collective_work`), "
             f"i.e. {links['tp']['latency_s'] * 1e6:.0f} us per message), "
             f"and the runtime's work from 1-weight parts ({o['action_s'] * 1e6:.0f} us per action, "
             f"{o['message_s'] * 1e6:.0f} us per SEND/RECV, {o['step_s'] * 1e3:.2f} ms per step). The DTensor "
             "dispatch a TP rank adds per operation is not in the model.")
    table = [["P x D x T", "predicted ms", "measured ms (median)", "min-max (IQR)", "error", "predicted rank",
              "measured rank", "TP link between barriers ms", "rank", "param bytes per rank"]] + [
        [r["mesh"], ms(r["predicted_s"]), ms(r["measured"]["median_s"]),
         f"{ms(r['min_s'])}-{ms(r['max_s'])} ({ms(r['measured']['q1_s'])}-{ms(r['measured']['q3_s'])})",
         f"{(r['measured']['median_s'] - r['predicted_s']) / r['predicted_s']:+.0%}", str(r["predicted_rank"]),
         str(r["measured_rank"]), ms(r["barrier_s"]), str(r["barrier_rank"]),
         "/".join(f"{b:,}" for b in sorted(set(r["param_bytes"])))] for r in part["rows"]]
    verdict = (f"The planner's first choice among all of world 4's meshes: {part['best_model']} (with the TP link "
               f"between barriers: {part['best_barrier_link']}); measured fastest: {part['best_measured']}; first "
               f"choice measured best: {mark(part['best_model'] == part['best_measured'])}.")
    return [intro, table, verdict]


def figures(part: Result, folder: str) -> list[tuple[str, str]]:
    """Predicted vs measured step time per mesh (every step, the median)."""
    fig = figure(6.0, 4.6)
    ax = fig.subplots()
    rows = part["rows"]
    top = max(max(r["max_s"], r["predicted_s"]) for r in rows) * 1.1e3
    for c, r in enumerate(rows):
        pred = r["predicted_s"] * 1e3
        ax.scatter([pred] * len(r["samples"]), [s * 1e3 for s in r["samples"]], color=f"C{c}", s=10, alpha=0.4)
        ax.scatter([pred], [r["measured"]["median_s"] * 1e3], color=f"C{c}", s=60, marker="D", edgecolor="black",
                   label=f"P x D x T = {r['mesh']}")
    ax.plot([0, top], [0, top], color="black", linewidth=0.8)
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="predicted step time, ms", ylabel="measured step time, ms")
    ax.set_title("World 4: the planner's step time per mesh against measurement", fontsize=9.5)
    ax.legend(fontsize=7)
    fig.savefig(os.path.join(folder, FIGURE))
    return [(FIGURE, "Predicted vs measured step time of every P x D x T mesh of world 4")]


PART = Part("plan_tp", "The planner's P x D x T choice vs measurement", PlanTPConfig(), QUICK, run, report, figures,
            block="plan-tp")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
