"""Part: PP=2 x TP=2 (4 gloo processes) against torch's pipelining with the same TP plan, steps alternating."""

from __future__ import annotations

import copy
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import pipelining as pp
from torch.distributed.tensor.parallel import parallelize_module

from benchmarks import harness, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result, bars, mark, ms
from benchmarks.models import TORCH_SCHEDULES, TorchPipe, frozen_sgd, num_stages
from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.launch.tasks.gpt import gpt_task, gpt_tp_plan
from duplexpipe.model.split import plan_partition
from duplexpipe.train.pipeline_config import SafetyConfig

SIDES = ("ours", "torch")
PP, TP = 2, 2
LOSS_TOLERANCE = 1e-4  # relative difference of the two sides' losses (same weights and data, float32)


@dataclass(frozen=True)
class VsTorchTPConfig:
    """The GPT example at PP=2 x TP=2 with the bundled TP plan (`gpt_tp_plan`), both sides in the same processes on
    the same DeviceMesh, trained with SGD at lr 0 (the weights stay put, so every step does the same work)."""

    n_layer: int = 4  # GPT blocks, dealt to the model parts (2 parts for 1F1B, 4 for the V schedules)
    d_model: int = 256  # GPT width
    n_head: int = 4  # attention heads (TP=2 holds 2 each)
    block_size: int = 64  # characters per sequence
    batch: int = 16  # sequences per step
    microbatches: int = 8  # microbatches per step
    schedules: tuple[str, ...] = ("1f1b", "zbv")  # keys of `models.TORCH_SCHEDULES`: 1F1B and a zero-bubble one
    sequence_parallel: tuple[bool, ...] = (False, True)  # each schedule without and with sequence parallelism
    warmup: int = 2  # untimed steps per side first
    reps: int = 20  # timed steps per side; the sides alternate which goes first
    target: float = 1.0  # ours / torch median step time, at most


QUICK = VsTorchTPConfig(n_layer=4, d_model=32, batch=8, microbatches=4, sequence_parallel=(False,), warmup=1, reps=2)


def _parts(cfg: VsTorchTPConfig, key: str) -> tuple[list[nn.Module], Any]:
    """The GPT as the schedule's model parts (children embedding, layer<i>, head: what the plan names) and its
    task (batches); identical on every process."""
    task = gpt_task(n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head, block_size=cfg.block_size)
    partition = plan_partition(task.layers, num_stages(key, PP), "uniform", embedding=task.embedding, head=task.head)
    return list(deep.build_parts(task.layers, partition, embedding=task.embedding, head=task.head)), task


def _torch_pipe(key: str, parts: list[nn.Module], mesh: Any, plan: dict[str, Any], cfg: VsTorchTPConfig,
                loss: Any) -> TorchPipe:
    """This rank's stages as torch PipelineStages over the "pp" group, each parallelised with torch's
    `parallelize_module` over the "tp" sub-mesh with the plan's styles (its keys resolved per part)."""
    cls_name, placement = TORCH_SCHEDULES[key]
    total, rank = num_stages(key, PP), mesh["pp"].get_local_rank()
    local = {"linear": [rank], "looped": [rank, rank + PP], "v": [rank, 2 * PP - 1 - rank]}[placement]
    modules = {s: copy.deepcopy(parts[s]) for s in local}
    for module in modules.values():
        concrete = {path: style for k, style in plan.items() for path, _ in deep.resolve(module, k)}
        parallelize_module(module, mesh["tp"], concrete, src_data_rank=None)
    group = mesh["pp"].get_group()
    stages = [pp.PipelineStage(modules[s], s, total, torch.device("cpu"), group=group) for s in local]
    schedule = getattr(pp, cls_name)(stages[0] if placement == "linear" else stages, cfg.microbatches, loss_fn=loss,
                                     scale_grads=True)
    return TorchPipe(modules, schedule, 0 in local, total - 1 in local,
                     frozen_sgd([p for s in local for p in modules[s].parameters()]))


def _expected_bytes(parts: list[nn.Module], local: list[int], facts: list[Any]) -> int:
    """What a TP rank should hold of its stages: each part's replicated parameters whole, the rest / TP."""
    whole = [sum(p.numel() * p.element_size() for p in part.parameters()) for part in parts]
    return sum(facts[s].replicated_param_bytes + (whole[s] - facts[s].replicated_param_bytes) // TP for s in local)


def build_sides(key: str, sp: bool, cfg: VsTorchTPConfig, mesh: Any, sides: tuple[str, ...] = SIDES
                ) -> tuple[list[Any], list[nn.Module], Any]:
    """The sides asked for (ours: a Pipeline; torch: a TorchPipe) of one schedule with or without SP over `mesh`, the
    model parts they were built from and the step's batch."""
    torch.manual_seed(0)
    parts, task = _parts(cfg, key)
    plan = gpt_tp_plan(sp)
    built: list[Any] = []
    if "ours" in sides:
        built.append(Pipeline(copy.deepcopy(parts), task.loss_fn, frozen_sgd,
                              PipelineConfig(schedule=key, num_microbatches=cfg.microbatches, sequence_parallel=sp,
                                             safety=SafetyConfig(check_inputs_every_step=False)),
                              mesh=mesh, tp_plan=plan))
    if "torch" in sides:
        built.append(_torch_pipe(key, parts, mesh, plan, cfg, task.loss_fn))
    return built, parts, task.batch(0, cfg.batch)


def _case(key: str, sp: bool, cfg: VsTorchTPConfig, mesh: Any) -> dict[str, Any]:
    """One schedule with or without SP: both sides built over `mesh`, stepped round-robin."""
    (ours, theirs), parts, (x, y) = build_sides(key, sp, cfg, mesh)
    traces = harness.RoundRobin[Any]([ours, theirs], lambda pipe, _: pipe.step(x, y)).run(cfg.reps, cfg.warmup)
    facts = deep.tp_facts(parts, x[:cfg.batch // cfg.microbatches], gpt_tp_plan(False))
    assert facts is not None
    local = sorted(ours.stage_modules)
    their_losses = [float(torch.stack(out).detach().mean()) for out in traces[1].out if out]
    return {"samples": {"ours": traces[0].wall, "torch": traces[1].wall},
            "cpu": {"ours": traces[0].cpu, "torch": traces[1].cpu},
            "param_bytes": {"ours": ours.param_bytes,
                            "torch": sum(deep.local_bytes(m) for m in theirs.modules.values()),
                            "expected": _expected_bytes(parts, local, facts),
                            "whole_model": sum(p.numel() * p.element_size() for part in parts
                                               for p in part.parameters())},
            "losses": {"ours": [float(v) for v in traces[0].out], "torch": their_losses}}


def worker(rank: int, world: int, cfg: VsTorchTPConfig) -> dict[str, Any]:
    """Every (schedule, SP) case on this rank."""
    mesh = make_mesh(PP, tp=TP)
    return {f"{key} sp={sp}": _case(key, sp, cfg, mesh) for key in cfg.schedules for sp in cfg.sequence_parallel}


def summarize(cfg: VsTorchTPConfig, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case: medians, ours / torch and the paired ratio, CPU over the ranks, parameter bytes per rank,
    whether both sides computed the same loss."""
    rows = []
    for name, res in per_rank[0].items():
        ours, theirs = (harness.summarize(res["samples"][s]) for s in SIDES)
        cpu = {s: 1e3 * statistics.median(map(sum, zip(*(r[name]["cpu"][s] for r in per_rank), strict=True)))
               for s in SIDES}
        mine = per_rank[-1][name]["losses"]  # the last rank holds a last stage on both sides
        gap = max((abs(a - b) / abs(b) for a, b in zip(mine["ours"], mine["torch"], strict=False)), default=0.0)
        key, _, sp = name.partition(" sp=")
        rows.append({"case": name, "schedule": key, "sequence_parallel": sp == "True",
                     "torch_class": TORCH_SCHEDULES[key][0], "ours": ours.to_dict(), "torch": theirs.to_dict(),
                     "ratio": ours.median / theirs.median, "target": cfg.target, "cpu_ms": cpu,
                     "paired_ratio": harness.summarize([a / b for a, b in zip(
                         res["samples"]["ours"], res["samples"]["torch"], strict=True)]).to_dict(),
                     "param_bytes": [r[name]["param_bytes"] for r in per_rank], "loss_gap": gap,
                     "samples": res["samples"]})
    return rows


def run(cfg: VsTorchTPConfig) -> Result:
    """Spawn the 4 ranks once; the rows."""
    return {"rows": summarize(cfg, harness.spawn(worker, cfg, PP * TP, 1800)), "config": asdict(cfg)}


def report(result: Result) -> list[Block]:
    """The speed table, then the parameter bytes per rank."""
    cfg = result["config"]
    intro = (f"GPT example (n_layer {cfg['n_layer']}, d_model {cfg['d_model']}, {cfg['n_head']} heads, batch "
             f"{cfg['batch']} x {cfg['block_size']} characters, M={cfg['microbatches']}) at PP=2 x TP=2: 4 gloo "
             "processes, one DeviceMesh; ours `Pipeline(mesh=make_mesh(2, tp=2), tp_plan=gpt_tp_plan(sp))`, torch's "
             "`PipelineStage` + the schedule class on the mesh's \"pp\" group, each stage parallelised by torch's "
             "`parallelize_module` over the \"tp\" sub-mesh with the same plan; SGD at lr 0 on both sides, "
             f"{cfg['warmup']} warm-up + {cfg['reps']} timed steps per side, alternating (the side that goes first "
             "rotates); a step is the slowest rank's wall time between barriers.")
    speed = [["schedule", "SP", "torch class", "ours ms (median)", "torch ms (median)", "ours IQR", "torch IQR",
              "ours/torch", "paired ratio (median, IQR)", "target", "met", "CPU ms ours / torch (4 ranks)",
              "loss gap"]] + [
        [r["schedule"], "yes" if r["sequence_parallel"] else "no", r["torch_class"], ms(r["ours"]["median_s"]),
         ms(r["torch"]["median_s"]), *(f"{ms(r[s]['q1_s'])}-{ms(r[s]['q3_s'])}" for s in SIDES), f"{r['ratio']:.2f}",
         "{median_s:.2f} ({q1_s:.2f}-{q3_s:.2f})".format(**r["paired_ratio"]), f"<= {r['target']:g}",
         mark(r["ratio"] <= r["target"]), f"{r['cpu_ms']['ours']:.0f} / {r['cpu_ms']['torch']:.0f}",
         f"{r['loss_gap']:.1e}"] for r in result["rows"]]
    first = result["rows"][0]["param_bytes"][0]["whole_model"] if result["rows"] else 0
    sizes = [["schedule", "SP", "rank", "ours bytes", "torch bytes", "expected (replicated + rest / TP)",
              "whole model / (PP x TP)"]] + [
        [r["schedule"], "yes" if r["sequence_parallel"] else "no", str(k), f"{b['ours']:,}", f"{b['torch']:,}",
         f"{b['expected']:,}", f"{b['whole_model'] // (PP * TP):,}"]
        for r in result["rows"] for k, b in enumerate(r["param_bytes"])]
    return [intro, speed, f"Parameter bytes per rank (the whole model: {first:,} bytes; the V schedule's rank holds "
            "two parts, its first and last stage; replicated: the LayerNorms, the row-parallel layers' biases, the "
            "embedding and the head, which the bundled plan leaves whole):", sizes]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Ours / torch per case."""
    rows = result["rows"]
    bars(os.path.join(folder, "bench_tp_ratios.png"), [r["case"] for r in rows],
         {"PP=2 x TP=2": [r["ratio"] for r in rows]}, 1.0, "parity", "median step time, ours / torch",
         "duplexpipe vs torch.distributed.pipelining, both with the same TP plan (lower is better)")
    return [("bench_tp_ratios.png", "Median step time at PP=2 x TP=2, ours / torch")]


PART = Part("vs_torch_tp", "PP x TP vs torch.distributed.pipelining with parallelize_module", VsTorchTPConfig(), QUICK,
            run, report, figures, block="tp-vs-torch")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
