"""Part: the planner's step time and peak activation bytes against runs of the GPT example."""

from __future__ import annotations

import copy
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness, models, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result, figure, mark, ms
from benchmarks.measure_overhead import CalibrationRun, measure_in_pipeline, measure_overhead
from duplexpipe import (
    CostModel,
    Pipeline,
    PipelineConfig,
    PlanConfig,
    Profile,
    Schedule,
    build_schedule,
    plan,
    plan_partition,
    profile_parts,
)
from duplexpipe.train.pipeline_config import ObserveConfig, SafetyConfig

NO_LIMIT = 2**62  # the planner's memory cap: none
TIME_TARGET = 0.25  # |measured - predicted| / predicted step time, at most
BYTES_TARGET = 0.10  # |measured - predicted| / predicted peak activation bytes, at most
ORDER_GAP = 0.15  # candidates predicted more than this fraction apart must be measured in that order
FIGURE = "plan_vs_measured.png"
SHORT = MappingProxyType({"all_cores": "all C cores (no share fitted)",
                          "previous": "previous model (1-weight calibration)", "no_cores": "device per rank",
                          "cores_only": "C cores only", "alone_linear": "alone, linear", "old": "old prediction"})
"""Column titles of the comparison predictions."""


@dataclass(frozen=True)
class PvMConfig:
    """The GPT example in 2P parts, profiled and calibrated, each candidate planned and trained round-robin. Targets:
    peaks within 10%, step times within 25%, candidates predicted more than 15% apart measured in that order."""

    ranks: int = 4  # pipeline ranks (gloo processes)
    n_layer: int = 8  # GPT blocks (2P model parts of one block each, embedding and head in the first and last)
    d_model: int = 64  # GPT width
    batch_size: int = 32  # sequences per step (64 characters each)
    candidates: tuple[tuple[str, int], ...] = (("1f1b", 4), ("1f1b", 8), ("zb-h1", 8), ("interleaved-1f1b", 8),
                                               ("zbv", 16))  # (schedule, M) planned and run (interleaved: 2 chunks)
    steps: int = 10  # measured steps of every candidate
    warmup: int = 2  # unmeasured steps of every candidate first
    profile_repeats: int = 10  # profile_parts repeats (the fastest is kept)
    overhead_steps: int = 30  # steps of the counting-overhead check, each with counting on and off
    calibration_steps: int = 30  # measured steps of each run of the runtime-overhead calibrations
    calibration: tuple[tuple[str, int], ...] = (("gpipe", 4), ("gpipe", 8), ("zb-h1", 4), ("interleaved-1f1b", 4))
    """(schedule, M) the in-pipeline calibration trains (none a candidate; fused and split backward, two M, and
    GPipe's compute in twice the actions: `planner.calibrate.calibration_runs`; interleaved with 2 chunks)."""
    scripted_cpu: tuple[float, ...] = ()
    """(compute scale, seconds per compute action, per SEND/RECV, per step): the in-pipeline calibration's steps are
    charged these CPU costs instead of the clock's (tests: a fit that cannot fail by load); () reads the clock."""

    def __post_init__(self) -> None:
        shared = set(self.calibration) & set(self.candidates)
        if shared:
            raise ValueError(f"calibration runs {sorted(shared)} are candidates too: calibrate on other (schedule, M)")
        if len(self.scripted_cpu) not in (0, 4):
            raise ValueError(f"scripted_cpu takes 4 costs (compute scale, per action, per SEND/RECV, per step) or "
                             f"none, got {self.scripted_cpu}")


QUICK = PvMConfig(ranks=2, n_layer=4, d_model=32, batch_size=8, candidates=(("1f1b", 2), ("zb-h1", 4)), steps=2,
                  warmup=1, profile_repeats=3, overhead_steps=2, calibration_steps=5,
                  calibration=(("gpipe", 2), ("gpipe", 4), ("zb-h1", 2), ("interleaved-1f1b", 2)))
"""A smoke run: 2 ranks, a narrow model, 2 candidates (their microbatches of 4 and 2 rows: an affine profile)."""


@dataclass(frozen=True)
class Candidate:
    """The planner's answer for one (schedule, M)."""

    result: deep.PlanResult  # the plan
    profile: Profile  # the profile it was made with
    schedule: Schedule  # the schedule it chose
    groups: tuple[int, ...]  # profiled parts per model part

    def merged_parts(self, parts: list[nn.Module]) -> list[nn.Module]:
        """The profiled parts merged as the planner grouped them."""
        return deep.merge_parts(parts, self.groups)

    def grouped(self, batch: int) -> tuple[deep.PartProfile, ...]:
        """Its profile at its microbatch, grouped as its parts are merged."""
        return self.profile.at_microbatch(batch / self.schedule.num_microbatches).grouped(self.schedule.num_groups,
                                                                                          list(self.groups))


def _from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    payload = [value]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _profiles(parts: list[nn.Module], batch: tuple[Any, Any], loss: Any, cfg: PvMConfig) -> dict[str, Profile]:
    """Rank 0's profile alone (the new model: affine between the candidates' microbatches, fused B, cold caches),
    then every rank's at once, rank 0's kept (the old prediction's: batch / 8 rows, linear, warm caches)."""
    largest, smallest = (cfg.batch_size // pick(m for _, m in cfg.candidates) for pick in (min, max))
    x, y = batch[0][:largest], batch[1][:largest]
    alone = None
    if dist.get_rank() == 0:
        bytes_only = profile_parts(copy.deepcopy(parts), x, target=y, loss_fn=loss, repeats=1, warmup=0, fit_rows=0,
                                   fused=False)
        evict = max(deep.cache_evict_bytes(), sum(p.activation_bytes for p in bytes_only.parts))
        alone = profile_parts(copy.deepcopy(parts), x, target=y, loss_fn=loss, repeats=cfg.profile_repeats, warmup=2,
                              fit_rows=smallest if smallest < largest else 0, evict_bytes=evict).to_dict()
    dist.barrier()
    alone = _from_rank0(alone)
    rows = cfg.batch_size // 8
    loaded = profile_parts(copy.deepcopy(parts), batch[0][:rows], target=batch[1][:rows], loss_fn=loss,
                           repeats=cfg.profile_repeats, warmup=2, fit_rows=0, fused=False)
    dist.barrier()
    return {"alone": Profile.from_dict(alone), "loaded": Profile.from_dict(_from_rank0(loaded.to_dict()))}


def _round_trip(nbytes: int, reps: int) -> float:
    """Median seconds of a send from rank 0 to rank 1 and back, of `nbytes` each way (other ranks wait)."""
    buf = torch.zeros(max(1, nbytes // 4))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _measure_link(nbytes: int, reps: int = 30) -> deep.Link:
    """The stage-to-stage link as the planner models it, from round trips of 4 and `nbytes` bytes (rank 0's)."""
    dist.barrier()
    small, big = _round_trip(4, reps), _round_trip(nbytes, reps)
    latency, bandwidth = _from_rank0((small / 2, 1 / max((big - small) / 2 / max(1, nbytes - 4), 1e-15)))
    return deep.Link(bandwidth=bandwidth, latency=latency)


def _candidate(profile: Profile, cfg: PvMConfig, name: str, m: int, link: deep.Link | None = None,
               cores: float | None = None) -> Candidate:
    """The planner's row and schedule for one (schedule, M), with the parts grouped as it grouped them."""
    result = plan(profile, PlanConfig(ranks=cfg.ranks, batch=cfg.batch_size, memory=NO_LIMIT, schedules=(name,),
                                      microbatches=(m,), chunks=(2,), compressions=("none",),
                                      p2p_link=link or deep.Link(), cores=cores))
    assert result.schedule is not None
    counts = deep.balanced_split([p.forward_s + p.backward_s for p in profile.parts], result.schedule.num_groups)
    return Candidate(result, profile, result.schedule, tuple(counts))


def _overhead(cfg: PvMConfig, ranks: int) -> dict[str, list[float]]:
    """1F1B on the overhead-bound MLP, counting on and off alternately: each step's slowest-rank seconds."""
    parts = models.build_parts(models.MLP, ranks)
    x, y = models.make_batch(models.MLP)
    pipes = [Pipeline(copy.deepcopy(parts), models.loss_fn, harness.adamw(), PipelineConfig(
        schedule="1f1b", num_microbatches=8, observe=ObserveConfig(record_timeline=False, count_saved_bytes=on),
        safety=SafetyConfig(check_inputs_every_step=False))) for on in (False, True)]
    off, on = harness.RoundRobin(pipes, lambda p, _: p.step(x, y)).run(cfg.overhead_steps, warmup=2)
    return {"on": on.wall, "off": off.wall}


def counting_cost(reps: int) -> dict[str, float]:
    """The MLP's forward + backward with and without SavedBytes counting, interleaved; the fastest of `reps`."""
    spec = models.ModelSpec("mlp", num_layers=8, width=256, batch=8)  # one microbatch of batch 64, M=8
    (model,), x = models.build_parts(spec, 1), torch.randn(spec.batch, spec.width)
    meter = deep.SavedBytes(model.parameters())
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2 * reps + 4):
        on = bool(k % 2)
        start = time.perf_counter()
        if on:
            meter.start(data=[x])
        with meter.counting() if on else nullcontext():
            out = model(x)
        out.sum().backward()
        if k >= 4:
            times[on].append(time.perf_counter() - start)
    return {"on_s": min(times[True]), "off_s": min(times[False]), "ratio": min(times[True]) / min(times[False])}


def _run_config() -> PipelineConfig:
    """The flags of every measured Pipeline (and of the calibration's)."""
    return PipelineConfig(grad_clip_norm=1.0, observe=ObserveConfig(record_timeline=False, count_saved_bytes=True),
                          safety=SafetyConfig(check_inputs_every_step=False))


def _calibrate(parts: list[nn.Module], sample: Any, link: deep.Link, cfg: PvMConfig, cores: int) -> dict[str, Any]:
    """The runtime's overhead from 1-weight parts (`measure_overhead`) and the model's prediction of its runs."""
    with torch.no_grad():
        message = torch.zeros_like(parts[0](sample))
    cal = measure_overhead(message, steps=cfg.calibration_steps, config=_run_config())
    o, t = cal.overhead, cal.tiny
    assert t is not None
    machine = deep.Machine.of(cores, o)
    cost = CostModel(f=t.forward_s, b=t.backward_s, w=t.backward_weight_s, latency=link.latency,
                     bandwidth=link.bandwidth, activation_bytes=float(message.numel() * message.element_size()))
    check = [{"run": f"{name}, M={m}", "measured_s": wall,
              "predicted_s": deep.simulate_shared(build_schedule(name, cfg.ranks, m), cost, machine).step}
             for (name, m), wall in cal.wall_s.items()]
    return {"overhead": o.to_dict(), "check": check, "samples": [asdict(x) for x in cal.samples],
            "message_shape": list(message.shape), "cores": cores}


def _cpu_timer(runs: list[CalibrationRun], scripted: tuple[float, ...]) -> Callable[[], float]:
    """The CPU clock, or with `scripted` costs a clock charging each run's step what they make of this rank's compute,
    actions and messages (the terms the calibration solves for)."""
    if not scripted:
        return time.process_time
    scale, action, message, step = scripted
    rank = dist.get_rank()
    costs = [scale * deep.rank_work(r.schedule, r.groups)[rank] + action * deep.rank_counts(r.schedule)[rank][0]
             + message * deep.rank_counts(r.schedule)[rank][1] + step for r in runs]
    return harness.ScriptedStepClock(costs)


def _calibrate_in_pipeline(parts: list[nn.Module], batch: tuple[Any, Any], loss: Any, profile: Profile,
                           link: deep.Link, cfg: PvMConfig, cores: int) -> dict[str, Any]:
    """The compute scale and the runtime's work from the real parts on `cfg.calibration` and the model's prediction
    of those runs; the solver's ValueError as "error" when the samples cannot separate the terms."""
    chosen = [_candidate(profile, cfg, name, m, link) for name, m in cfg.calibration]
    runs = [CalibrationRun(c.schedule, c.merged_parts(copy.deepcopy(parts)), c.grouped(cfg.batch_size)) for c in chosen]
    try:
        cal = measure_in_pipeline(runs, batch, loss, harness.adamw(), steps=cfg.calibration_steps, config=_run_config(),
                                  cpu_timer=_cpu_timer(runs, cfg.scripted_cpu))
    except ValueError as exc:
        return {"overhead": None, "check": [], "samples": [], "error": str(exc)}
    model = replace(profile, overhead=cal.overhead)
    check = [{"run": f"{name}, M={m}", "measured_s": cal.wall_s[(name, m)],
              "predicted_s": _candidate(model, cfg, name, m, link, cores).result.best.step_s}
             for name, m in cfg.calibration]
    return {"overhead": cal.overhead.to_dict(), "check": check, "samples": [asdict(x) for x in cal.samples]}


def _fitted_cores(profile: Profile, in_pipeline: dict[str, Any], cfg: PvMConfig, link: deep.Link,
                  cores: int) -> float:
    """The share of the C cores the in-pipeline calibration runs got (`fit_cores` to their measured walls)."""
    if in_pipeline["overhead"] is None:
        return float(cores)
    model = replace(profile, overhead=deep.RuntimeOverhead.from_dict(in_pipeline["overhead"], "in pipeline"))
    config = PlanConfig(ranks=cfg.ranks, batch=cfg.batch_size, memory=NO_LIMIT, p2p_link=link, cores=cores)
    runs = [(name, m, c["measured_s"]) for (name, m), c in zip(cfg.calibration, in_pipeline["check"], strict=True)]
    return deep.fit_cores(model, config, runs, float(cores))


VARIANTS = MappingProxyType({
    "model": "profiled alone, affine, compute scale and runtime overhead from the real parts, the share of the C cores "
             "the calibration runs got (fitted to their walls: `fit_cores`, what `duplexpipe plan` does with a "
             "calibrated profile)",
    "all_cores": "the same on all C cores",
    "previous": "profiled alone, affine, runtime overhead from 1-weight parts (compute scale 1), C cores "
                "(the previous model)",
    "no_cores": "the new model with a device per rank",
    "cores_only": "profiled alone, linear, no overhead, C cores",
    "alone_linear": "profiled alone, linear, no overhead, a device per rank",
    "old": "profiled with every rank at once, linear, no overhead, a device per rank (the old prediction)",
})  # the predictions compared (all with the measured link)


def _variants(profiles: dict[str, Profile], overhead: dict[str, dict[str, Any] | None], cfg: PvMConfig, link: deep.Link,
              cores: int, share: float) -> dict[str, list[Candidate]]:
    """Each prediction of `VARIANTS` for every candidate."""
    previous = replace(profiles["alone"], overhead=deep.RuntimeOverhead.from_dict(overhead["tiny"], "calibration"))
    fitted = overhead["in_pipeline"]
    model = previous if fitted is None else replace(profiles["alone"],
                                                    overhead=deep.RuntimeOverhead.from_dict(fitted, "in pipeline"))
    settings = {"model": (model, share), "all_cores": (model, cores), "previous": (previous, cores),
                "no_cores": (model, None),
                "cores_only": (model.basic(), cores), "alone_linear": (model.basic(), None),
                "old": (profiles["loaded"].basic(), None)}
    return {key: [_candidate(prof, cfg, name, m, link, c) for name, m in cfg.candidates]
            for key, (prof, c) in settings.items()}


def _model_cpu(choice: Candidate, cfg: PvMConfig) -> list[float]:
    """Per rank: the CPU seconds the new model charges for one step of the candidate (`rank_work`)."""
    return deep.rank_work(choice.schedule, choice.grouped(cfg.batch_size), choice.profile.overhead)


def _worker(rank: int, world: int, cfg: PvMConfig) -> dict[str, Any]:
    task = harness.gpt(cfg.n_layer, cfg.d_model)
    partition = plan_partition(task.layers, 2 * world, "uniform", embedding=task.embedding, head=task.head)
    parts: list[nn.Module] = list(deep.build_parts(task.layers, partition, embedding=task.embedding, head=task.head))
    x, y = task.batch(0, cfg.batch_size)
    rows = cfg.batch_size // 8
    profiles = _profiles(parts, (x, y), task.loss_fn, cfg)
    message = max(p.output_bytes for p in profiles["loaded"].at_microbatch(cfg.batch_size / 8).parts[:-1])
    link = _measure_link(int(message))
    cores = len(os.sched_getaffinity(0))
    calibration = _calibrate(parts, x[:rows], link, cfg, cores)
    in_pipeline = _calibrate_in_pipeline(parts, (x, y), task.loss_fn, profiles["alone"], link, cfg, cores)
    fitted = _fitted_cores(profiles["alone"], in_pipeline, cfg, link, cores)
    in_pipeline["fitted_cores"] = fitted
    variants = _variants(profiles, {"in_pipeline": in_pipeline["overhead"], "tiny": calibration["overhead"]}, cfg,
                         link, cores, fitted)
    choices = variants["model"]
    pipes = [Pipeline(c.merged_parts(copy.deepcopy(parts)), task.loss_fn, harness.adamw(),
                      replace(_run_config(), schedule=c.schedule)) for c in choices]
    traces = harness.RoundRobin(pipes, harness.gpt_step(task, cfg.batch_size),
                                lambda p: p.last.peak_saved_bytes if p.last else 0).run(cfg.steps, cfg.warmup)
    out: dict[str, Any] = {"seconds": [t.wall for t in traces], "peaks": [t.extra for t in traces],
                           "cpu": [statistics.median(t.cpu) for t in traces], "overhead": _overhead(cfg, world)}
    dist.barrier()
    if rank == 0:
        out.update(counting=counting_cost(max(3, cfg.overhead_steps)), calibration=calibration,
                   profiles={k: p.to_dict() for k, p in profiles.items()}, in_pipeline=in_pipeline,
                   link={"latency_s": link.latency, "bandwidth": link.bandwidth, "message_bytes": message})
        out["plans"] = [{"row": c.result.best.to_dict(), "groups": list(c.groups), "cpu_model": _model_cpu(c, cfg),
                         "cpu_previous": _model_cpu(variants["previous"][i], cfg),
                         "variants": {k: {"step_s": v[i].result.best.step_s, "groups": list(v[i].groups)}
                                      for k, v in variants.items()}} for i, c in enumerate(choices)]
    dist.barrier()
    return out


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else float("inf")


def summarize(per_rank: list[dict[str, Any]], cfg: PvMConfig) -> list[dict[str, Any]]:
    """One row per candidate: predicted vs measured step time and peak activation bytes (max over ranks)."""
    lead = per_rank[0]
    rows = []
    for c, plan_row in enumerate(lead["plans"]):
        row, samples = plan_row["row"], lead["seconds"][c]
        predicted_acts = [m["activations"] for m in row["per_rank"]]
        measured_acts = [max(r["peaks"][c]) for r in per_rank]
        step = harness.summarize(samples)
        rows.append({"candidate": f"{row['schedule']}, M={row['microbatches']}", "groups": plan_row["groups"],
            "predicted_s": row["step_s"], "cpu_model": plan_row["cpu_model"], "cpu": [r["cpu"][c] for r in per_rank],
            "variants": {k: dict(v, err=_rel(step.median, v["step_s"])) for k, v in plan_row["variants"].items()},
            "cpu_previous": plan_row["cpu_previous"], "time_err": _rel(step.median, row["step_s"]),
            "measured": step.to_dict(), "min_s": min(samples), "max_s": max(samples), "samples": samples,
            "predicted_acts": predicted_acts, "measured_acts": measured_acts,
            "peaks_stable": all(len(set(r["peaks"][c])) == 1 for r in per_rank),
            "bytes_err": _rel(max(measured_acts), max(predicted_acts)),
            "bytes_err_per_rank": max(abs(_rel(m, p)) for m, p in zip(measured_acts, predicted_acts, strict=True)), })
    return rows


def order_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of candidates predicted more than ORDER_GAP apart, and whether the measured medians agree."""
    out = []
    for a, b in itertools.combinations(rows, 2):
        fast, slow = (a, b) if a["predicted_s"] <= b["predicted_s"] else (b, a)
        gap = slow["predicted_s"] / fast["predicted_s"] - 1
        if gap > ORDER_GAP:
            out.append({"faster": fast["candidate"], "slower": slow["candidate"], "predicted_gap": gap,
                        "measured_gap": slow["measured"]["median_s"] / fast["measured"]["median_s"] - 1,
                        "same_order": fast["measured"]["median_s"] < slow["measured"]["median_s"]})
    return out


def run(cfg: PvMConfig) -> Result:
    """Measure; the rows, the order check, the counting overhead, the profiles and the configuration."""
    per_rank = harness.spawn(_worker, cfg, cfg.ranks, 3600)
    rows, lead = summarize(per_rank, cfg), per_rank[0]
    on, off = lead["overhead"]["on"], lead["overhead"]["off"]
    overhead = {"on": harness.summarize(on).to_dict(), "off": harness.summarize(off).to_dict(),
                "paired_ratio": statistics.median(a / b for a, b in zip(on, off, strict=True))}
    return {"rows": rows, "order": order_pairs(rows), "overhead": overhead, "variants": dict(VARIANTS),
            "config": asdict(cfg), **{k: lead[k] for k in ("counting", "link", "profiles", "calibration",
                                                           "in_pipeline")}}


def table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per candidate: the new model's prediction, the measurement, the comparisons."""
    return [["candidate", "parts per stage", "predicted ms", "measured ms (median)", "min-max (IQR)", "error",
             "met (25%)", *(x for title in SHORT.values() for x in (f"{title} ms", "error")),
             "predicted peak act. (max rank)", "measured peak", "error", "worst rank error", "met (10%)"]] + [
        [r["candidate"], "/".join(map(str, r["groups"])), ms(r["predicted_s"]), ms(r["measured"]["median_s"]),
         f"{ms(r['min_s'])}-{ms(r['max_s'])} ({ms(r['measured']['q1_s'])}-{ms(r['measured']['q3_s'])})",
         f"{r['time_err']:+.1%}", mark(abs(r["time_err"]) <= TIME_TARGET),
         *(x for v in (r["variants"][k] for k in SHORT) for x in (ms(v["step_s"]), f"{v['err']:+.1%}")),
         deep.format_bytes(max(r["predicted_acts"])), deep.format_bytes(max(r["measured_acts"])),
         f"{r['bytes_err']:+.2%}", f"{r['bytes_err_per_rank']:.2%}", mark(r["bytes_err_per_rank"] <= BYTES_TARGET)]
        for r in part["rows"]]


def order_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per pair predicted more than ORDER_GAP apart."""
    return [["predicted faster", "predicted slower", "predicted gap", "measured gap", "same order"]] + [
        [p["faster"], p["slower"], f"{p['predicted_gap']:+.0%}", f"{p['measured_gap']:+.0%}", mark(p["same_order"])]
        for p in part["order"]]


def calibration_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + each model's prediction of its own calibration runs (new: real parts; previous: 1-weight parts)."""
    out = [["calibration run", "model", "predicted ms", "measured ms (median)", "error"]]
    for key, title in (("in_pipeline", "new (real parts)"), ("calibration", "previous (1-weight parts)")):
        for c in part.get(key, {}).get("check", []):
            err = (c["measured_s"] - c["predicted_s"]) / c["predicted_s"]
            out.append([c["run"], title, *(f"{c[k] * 1e3:.2f}" for k in ("predicted_s", "measured_s")), f"{err:+.1%}"])
    return out


def cpu_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + per candidate: the CPU per step the models charge (all ranks) against the ranks' measured CPU time."""
    cores = part["calibration"]["cores"]
    out = [["candidate", "model CPU ms (all ranks)", "measured CPU ms (all ranks)", "measured / model",
            "previous model CPU ms", "measured / previous", f"measured CPU / {cores} cores ms", "measured step ms"]]
    for r in part["rows"]:
        model, real, previous = sum(r["cpu_model"]), sum(r["cpu"]), sum(r.get("cpu_previous", [math.nan]))
        out.append([r["candidate"], ms(model), ms(real), f"{real / model:.2f}", ms(previous),
                    f"{real / previous:.2f}", ms(real / cores), ms(r["measured"]["median_s"])])
    return out


def _model_note(part: dict[str, Any]) -> str:
    """How every term of the new model was measured, with its values."""
    cal, link = part["calibration"], part["link"]
    o, n = cal["overhead"], part["in_pipeline"]["overhead"]
    if n is None:  # the in-pipeline calibration could not separate its terms: the previous model stands in
        n = dict(o, method=f"FAILED, the previous model's terms used instead: {part['in_pipeline']['error']}")
    alone = part["profiles"]["alone"]
    return (f"The new model ('predicted'): rank 0's profile taken alone (the other ranks waiting; fastest of "
            f"{alone['meta']['repeats']}, round by round over the parts), each pass affine in the rows (timed "
            f"at {alone['microbatch_size']} and {alone['meta']['fit_rows']} rows, the candidates' largest and "
            f"smallest microbatch), a full B timed as one fused pass, each pass after writing "
            f"{alone['meta'].get('evict_bytes', 0) / 2**20:.3g} MiB (the activations one microbatch keeps through the "
            f"whole model, what a 1F1B rank holds at its peak, at least twice the per-core L2: the caches are as "
            f"cold as between a part's passes in a pipeline); each rank's CPU per step as alpha x its "
            f"profiled compute + work per compute action, per SEND/RECV and per step, from a calibration "
            f"with the real parts on the same {part['config']['ranks']} ranks ({n['method']}; the parts merged "
            f"as the planner groups them, AdamW and clipping as in the candidates): alpha = "
            f"{n['compute_scale']:.3f}, {n['action_s'] * 1e6:.0f} us per compute action, {n['message_s'] * 1e6:.0f} "
            f"us per SEND/RECV, {n['step_s'] * 1e6:.0f} us per step (the previous model: alpha = 1 and the "
            f"runtime's work from {o['method']}: {o['action_s'] * 1e6:.0f} us per compute action, "
            f"{o['message_s'] * 1e6:.0f} us per SEND/RECV, {o['step_s'] * 1e6:.0f} us per step); the "
            f"stage-to-stage link (latency "
            f"{link['latency_s'] * 1e6:.0f} us per message, {link['bandwidth'] / 1e6:,.0f} MB/s, from rank 0-1 "
            f"round trips of 4 and {link['message_bytes']:,} bytes); and C = {cal['cores']} cores shared by the "
            f"ranks (`os.sched_getaffinity`), of which the calibration runs got "
            f"{part['in_pipeline'].get('fitted_cores', cal['cores']):.3g} (`fit_cores` to their walls; the "
            f"prediction's cores), simulated with processor sharing. Comparisons: "
            + "; ".join(f"'{SHORT[k]}': {part['variants'][k]}" for k in SHORT) + ".")


def report(part: Result) -> list[Block]:
    """How the candidates ran, how the model was measured, the tables, and the counting overhead."""
    cfg, ov = part["config"], part["overhead"]
    return [f"GPT example (n_layer {cfg['n_layer']}, d_model {cfg['d_model']}, batch {cfg['batch_size']} x 64 "
            f"characters), {cfg['ranks']} gloo ranks, {cfg['warmup']} warm-up + {cfg['steps']} measured steps per "
            f"candidate, round-robin. {_model_note(part)} Parts per stage: how the planner merged the "
            f"{2 * cfg['ranks']} profiled parts (each comparison groups by its own profile).", table(part),
            f"Pairs predicted more than {ORDER_GAP:.0%} apart (new model):", order_table(part),
            "The model on its own calibration runs (not a fit of the step: the solver fits CPU time per rank):",
            calibration_table(part),
            "CPU time per step (each rank's process, `time.process_time`, median of the measured steps):",
            cpu_table(part),
            f"Saved-bytes counting on the overhead-bound MLP (8 x Linear 256, batch 64, 1F1B, M=8, {cfg['ranks']} "
            f"ranks, {cfg['overhead_steps']} alternating steps each): median step {ms(ov['on']['median_s'])} ms "
            f"counted vs {ms(ov['off']['median_s'])} ms not; median paired ratio {ov['paired_ratio']:.3f}. In one "
            f"process (forward + backward of one microbatch of 8 rows, fastest of {max(3, cfg['overhead_steps'])} "
            f"each, interleaved): {part['counting']['on_s'] * 1e3:.3f} ms counted vs "
            f"{part['counting']['off_s'] * 1e3:.3f} ms, ratio {part['counting']['ratio']:.3f}."]


def figures(part: Result, folder: str) -> list[tuple[str, str]]:
    """Predicted vs measured step time (every step, the median, the old prediction hollow) and peak activations."""
    fig = figure(11.5, 4.8)
    ax_t, ax_b = fig.subplots(1, 2)
    rows = part["rows"]
    right = max(max(r["predicted_s"], r["variants"]["old"]["step_s"]) for r in rows) * 1.4e3
    top = max(max(r["measured"]["median_s"] for r in rows) * 2e3, right)  # a disturbed step stays off the chart
    off = sum(s * 1e3 > top for r in rows for s in r["samples"])
    for c, r in enumerate(rows):
        pred, median = r["predicted_s"] * 1e3, r["measured"]["median_s"] * 1e3
        ax_t.scatter([pred] * len(r["samples"]), [s * 1e3 for s in r["samples"]], color=f"C{c}", s=10, alpha=0.4)
        ax_t.scatter([pred], [median], color=f"C{c}", s=60, marker="D", edgecolor="black", label=r["candidate"])
        ax_t.scatter([r["variants"]["old"]["step_s"] * 1e3], [median], s=60, marker="D", facecolor="none",
                     edgecolor=f"C{c}")
        for rank, (p, m) in enumerate(zip(r["predicted_acts"], r["measured_acts"], strict=True)):
            ax_b.scatter([p / 2**20], [m / 2**20], color=f"C{c}", s=40, marker="os^v"[rank % 4],
                         label=r["candidate"] if rank == 0 else None)
    high = max(max(r["predicted_acts"] + r["measured_acts"]) for r in rows) / 2**20 * 1.1
    for ax, (x, y), band, labels, title in (
            (ax_t, (right, top), 0.25, ("predicted step time, ms", "measured step time, ms"),
             "Step time: steps (dots), median (diamond);\nhollow: the old prediction"
             + (f"; {off} steps above the chart" if off else "")),
            (ax_b, (high, high), 0.10, ("predicted peak activations, MiB",
                                        "measured peak (StepInfo.peak_saved_bytes), MiB"),
             "Peak live activation bytes, one marker per rank (o s ^ v = rank 0-3)")):
        ax.plot([0, x], [0, x], color="black", linewidth=0.8)
        ax.fill_between([0, x], [0, (1 - band) * x], [0, (1 + band) * x], color="grey", alpha=0.15,
                        label=f"within {band:.0%}")
        ax.set(xlim=(0, x), ylim=(0, y), xlabel=labels[0], ylabel=labels[1])
        ax.set_title(title, fontsize=9.5)
        ax.legend(fontsize=7)
    fig.savefig(os.path.join(folder, FIGURE))
    return [(FIGURE, "Predicted vs measured step time and peak activations")]


PART = Part("plan_vs_measured", "Planner predictions vs measurement", PvMConfig(), QUICK, run, report, figures,
            block="plan-vs-measured")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
