"""Part: the planner's step time and peak activation bytes against runs of the GPT example."""

from __future__ import annotations

import copy
import itertools
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness, models
from benchmarks import internals as deep
from benchmarks.framework import Part, Result
from benchmarks.measure_overhead import CalibrationRun, measure_in_pipeline, measure_overhead
from benchmarks.plan_vs_measured_report import ORDER_GAP, figures, report
from benchmarks.runner import main
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

NO_LIMIT = 2**62
"""The planner's memory cap: none."""


@dataclass(frozen=True)
class PvMConfig:
    """One spawn splits the GPT example into 2P parts and profiles them on rank 0 alone (the new model: affine in
    the rows, fused B, cold caches) and on every rank at once (the old prediction's profile); measures the
    stage-to-stage link; calibrates each rank's CPU per step as alpha x its profiled compute + work per action,
    message and step on the real parts (`measure_in_pipeline`, schedules that are not candidates) and, for the
    previous model, the runtime's work alone (`measure_overhead`: 1-weight parts); plans each candidate with the
    new model and the comparisons of VARIANTS; trains the candidates round-robin and measures each step's slowest
    rank and each rank's peak saved bytes. Targets: peaks within 10%, step times within 25%, candidates predicted
    more than 15% apart measured in the same order."""

    ranks: int = 4  # pipeline ranks (gloo processes)
    n_layer: int = 8  # GPT blocks (2P model parts of one block each, embedding and head in the first and last)
    d_model: int = 64  # GPT width
    batch_size: int = 32  # sequences per step (64 characters each)
    candidates: tuple[tuple[str, int], ...] = (("1f1b", 4), ("1f1b", 8), ("zb-h1", 8), ("interleaved-1f1b", 8),
                                               ("zbv", 16))
    """(schedule, M) pairs planned and run; interleaved-1f1b with 2 chunks."""
    steps: int = 10  # measured steps of every candidate
    warmup: int = 2  # unmeasured steps of every candidate first
    profile_repeats: int = 10  # profile_parts repeats (the fastest is kept)
    overhead_steps: int = 30  # steps of the counting-overhead check, each with counting on and off
    calibration_steps: int = 30  # measured steps of each run of the runtime-overhead calibrations
    calibration: tuple[tuple[str, int], ...] = (("gpipe", 4), ("gpipe", 8), ("zb-h1", 4))
    """(schedule, M) pairs the in-pipeline calibration trains with the real parts (none a candidate: the
    model is judged on schedules it was not fitted on; fused and split backward, two M)."""

    def __post_init__(self) -> None:
        shared = set(self.calibration) & set(self.candidates)
        if shared:
            raise ValueError(f"calibration runs {sorted(shared)} are candidates too: calibrate on other (schedule, M)")


QUICK = PvMConfig(ranks=2, n_layer=4, d_model=32, batch_size=8, candidates=(("1f1b", 2), ("zb-h1", 4)), steps=2,
                  warmup=1, profile_repeats=3, overhead_steps=2, calibration_steps=5,
                  calibration=(("gpipe", 2), ("gpipe", 4), ("zb-h1", 2)))
"""A smoke run: 2 ranks, a narrow model, 2 candidates (the profile affine between their microbatches, 4 and 2 rows,
so the calibration's compute column is not a copy of its step column)."""


@dataclass(frozen=True)
class Candidate:
    """The planner's answer for one (schedule, M): its result, the profile it planned with, the schedule and how
    many profiled parts each model part merges."""

    result: deep.PlanResult  # the plan
    profile: Profile  # the profile it was made with
    schedule: Schedule  # the schedule it chose
    groups: tuple[int, ...]  # profiled parts per model part

    def merged_parts(self, parts: list[nn.Module]) -> list[nn.Module]:
        """The profiled parts merged as the planner grouped them."""
        return deep.merge_parts(parts, self.groups)


def _shared(profile: Profile | None) -> Profile:
    """Rank 0's profile on every rank."""
    payload = [profile.to_dict() if profile is not None else None]
    dist.broadcast_object_list(payload, src=0)
    return Profile.from_dict(payload[0])


def _profiles(parts: list[nn.Module], batch: tuple[Any, Any], loss: Any, cfg: PvMConfig) -> dict[str, Profile]:
    """The parts profiled on rank 0 alone (the new model: on the candidates' largest microbatch, affine
    down to their smallest, fused B too, caches cold before each pass: it writes as many bytes as one
    microbatch keeps through the whole model, what a 1F1B rank holds at its peak), then on every rank at once
    (rank 0's kept: the old prediction's profile, on batch / 8 rows, linear, B = I + W, warm caches)."""
    largest = cfg.batch_size // min(m for _, m in cfg.candidates)
    smallest = cfg.batch_size // max(m for _, m in cfg.candidates)
    alone = None
    if dist.get_rank() == 0:
        sample = (batch[0][:largest], batch[1][:largest])
        bytes_only = profile_parts(copy.deepcopy(parts), sample[0], target=sample[1], loss_fn=loss, repeats=1,
                                   warmup=0, fit_rows=0, fused=False)
        evict = max(deep.cache_evict_bytes(), sum(p.activation_bytes for p in bytes_only.parts))
        alone = profile_parts(copy.deepcopy(parts), sample[0], target=sample[1], loss_fn=loss,
                              repeats=cfg.profile_repeats, warmup=2, fit_rows=smallest if smallest < largest else 0,
                              evict_bytes=evict)
    dist.barrier()
    alone_shared = _shared(alone)
    rows = cfg.batch_size // 8
    loaded = profile_parts(copy.deepcopy(parts), batch[0][:rows], target=batch[1][:rows], loss_fn=loss,
                           repeats=cfg.profile_repeats, warmup=2, fit_rows=0, fused=False)
    dist.barrier()
    return {"alone": alone_shared, "loaded": _shared(loaded if dist.get_rank() == 0 else None)}


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
    """The stage-to-stage link as the planner models it: latency per message and bandwidth, from
    round trips of 4 bytes and of `nbytes` (rank 0's figures, shared)."""
    dist.barrier()
    small, big = _round_trip(4, reps), _round_trip(nbytes, reps)
    latency = small / 2
    per_byte = max((big - small) / 2 / max(1, nbytes - 4), 1e-15)
    payload = [(latency, 1 / per_byte)]
    dist.broadcast_object_list(payload, src=0)
    return deep.Link(bandwidth=payload[0][1], latency=payload[0][0])


def _candidate(profile: Profile, cfg: PvMConfig, name: str, m: int, link: deep.Link | None = None,
               cores: int | None = None) -> Candidate:
    """The planner's row and schedule for one (schedule, M), with the parts grouped as it grouped them."""
    config = PlanConfig(ranks=cfg.ranks, batch=cfg.batch_size, memory=NO_LIMIT, schedules=(name,),
                        microbatches=(m,), chunks=(2,), compressions=("none",), p2p_link=link or deep.Link(),
                        cores=cores)
    result = plan(profile, config)
    assert result.schedule is not None
    counts = deep.balanced_split([p.forward_s + p.backward_s for p in profile.parts], result.schedule.num_groups)
    return Candidate(result, profile, result.schedule, tuple(counts))


def _train(pipes: list[Pipeline], task: Any, cfg: PvMConfig) -> tuple[list[list[float]], list[list[int]], list[float]]:
    """Round-robin steps; per candidate, the measured steps' seconds (slowest rank), this rank's peaks and
    the median of this rank's CPU seconds per step."""
    peak = lambda p: p.last.peak_saved_bytes if p.last else 0  # noqa: E731
    traces = harness.RoundRobin(pipes, harness.gpt_step(task, cfg.batch_size), peak).run(cfg.steps, cfg.warmup)
    return [t.wall for t in traces], [t.extra for t in traces], [statistics.median(t.cpu) for t in traces]


def _overhead(cfg: PvMConfig, ranks: int) -> dict[str, list[float]]:
    """1F1B on the overhead-bound MLP, counting on and off alternately: each step's slowest-rank seconds."""
    spec = models.ModelSpec("mlp", num_layers=8, width=256, batch=64)
    parts = models.build_parts(spec, ranks)
    x, y = models.make_batch(spec)
    pipes = [Pipeline(copy.deepcopy(parts), models.loss_fn, harness.adamw(), PipelineConfig(
        schedule="1f1b", num_microbatches=8, record_timeline=False, check_inputs_every_step=False,
        count_saved_bytes=on)) for on in (False, True)]
    off, on = harness.RoundRobin(pipes, lambda p, _: p.step(x, y)).run(cfg.overhead_steps, warmup=2)
    return {"on": on.wall, "off": off.wall}


def counting_cost(reps: int) -> dict[str, float]:
    """One process: the overhead-bound MLP's forward + backward with and without SavedBytes counting,
    interleaved; the fastest of `reps` each (contention only adds time)."""
    spec = models.ModelSpec("mlp", num_layers=8, width=256, batch=8)  # one microbatch of batch 64, M=8
    (model,) = models.build_parts(spec, 1)
    x = torch.randn(spec.batch, spec.width)
    meter = deep.SavedBytes(model.parameters())
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2 * reps + 4):
        on = bool(k % 2)
        start = time.perf_counter()
        if on:
            meter.start(data=[x])
            with meter.counting():
                out = model(x)
        else:
            out = model(x)
        out.sum().backward()
        if k >= 4:
            times[on].append(time.perf_counter() - start)
    return {"on_s": min(times[True]), "off_s": min(times[False]),
            "ratio": min(times[True]) / min(times[False])}


def _run_config() -> PipelineConfig:
    """The flags of every measured Pipeline (and of the calibration's)."""
    return PipelineConfig(grad_clip_norm=1.0, record_timeline=False, check_inputs_every_step=False,
                          count_saved_bytes=True)


def _calibrate(parts: list[nn.Module], sample: Any, link: deep.Link, cfg: PvMConfig, cores: int) -> dict[str, Any]:
    """The runtime's overhead on the real ranks (`measure_overhead` on messages of the first part's output
    shape), and the model's prediction of the calibration runs themselves (a check of the fit)."""
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


def _calibrate_in_pipeline(parts: list[nn.Module], batch: tuple[Any, Any], loss: Any, profile: Profile,
                           link: deep.Link, cfg: PvMConfig, cores: int) -> dict[str, Any]:
    """The compute scale and the runtime's work from the real parts on `cfg.calibration` (merged as the
    planner groups them, AdamW and clipping as the candidates run; `measure_in_pipeline`), and the
    resulting model's prediction of those runs (a check of the fit). When the samples cannot separate the
    terms (a smoke run's few noisy steps), the solver's ValueError is recorded as "error" and the new
    model is the previous one (every rank solves the same samples, so all of them take this branch)."""
    runs = []
    for name, m in cfg.calibration:
        choice = _candidate(profile, cfg, name, m, link)
        groups = profile.at_microbatch(cfg.batch_size / m).grouped(choice.schedule.num_groups, list(choice.groups))
        runs.append(CalibrationRun(choice.schedule, choice.merged_parts(copy.deepcopy(parts)), groups))
    try:
        cal = measure_in_pipeline(runs, batch, loss, harness.adamw(), steps=cfg.calibration_steps, config=_run_config())
    except ValueError as exc:
        return {"overhead": None, "check": [], "samples": [], "error": str(exc)}
    model = replace(profile, overhead=cal.overhead)
    check = [{"run": f"{name}, M={m}", "measured_s": cal.wall_s[(name, m)],
              "predicted_s": _candidate(model, cfg, name, m, link, cores).result.best.step_s}
             for name, m in cfg.calibration]
    return {"overhead": cal.overhead.to_dict(), "check": check, "samples": [asdict(x) for x in cal.samples]}


VARIANTS = MappingProxyType({
    "model": "profiled alone, affine, compute scale and runtime overhead from the real parts, C cores (the new model)",
    "previous": "profiled alone, affine, runtime overhead from 1-weight parts (compute scale 1), C cores "
                "(the previous model)",
    "no_cores": "the new model with a device per rank",
    "cores_only": "profiled alone, linear, no overhead, C cores",
    "alone_linear": "profiled alone, linear, no overhead, a device per rank",
    "old": "profiled with every rank at once, linear, no overhead, a device per rank (the old prediction)",
})
"""The predictions compared (all with the measured link)."""


def _variants(profiles: dict[str, Profile], overhead: dict[str, dict[str, Any] | None], cfg: PvMConfig, link: deep.Link,
              cores: int) -> dict[str, list[Candidate]]:
    """Each prediction of `VARIANTS` for every candidate."""
    previous = replace(profiles["alone"], overhead=deep.RuntimeOverhead.from_dict(overhead["tiny"], "calibration"))
    fitted = overhead["in_pipeline"]
    model = previous if fitted is None else replace(profiles["alone"],
                                                    overhead=deep.RuntimeOverhead.from_dict(fitted, "in pipeline"))
    settings = {"model": (model, cores), "previous": (previous, cores), "no_cores": (model, None),
                "cores_only": (model.basic(), cores),
                "alone_linear": (model.basic(), None), "old": (profiles["loaded"].basic(), None)}
    return {key: [_candidate(prof, cfg, name, m, link, c) for name, m in cfg.candidates]
            for key, (prof, c) in settings.items()}


def _model_cpu(choice: Candidate, cfg: PvMConfig) -> list[float]:
    """Per rank: the CPU seconds the new model charges for one step of the candidate (`rank_work`)."""
    schedule, profile = choice.schedule, choice.profile
    groups = profile.at_microbatch(cfg.batch_size / schedule.num_microbatches).grouped(schedule.num_groups,
                                                                                       list(choice.groups))
    return deep.rank_work(schedule, groups, profile.overhead)


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
    variants = _variants(profiles, {"in_pipeline": in_pipeline["overhead"], "tiny": calibration["overhead"]}, cfg,
                         link, cores)
    choices = variants["model"]
    pipes = [Pipeline(c.merged_parts(copy.deepcopy(parts)), task.loss_fn, harness.adamw(),
                      replace(_run_config(), schedule=c.schedule)) for c in choices]
    seconds, peaks, cpu = _train(pipes, task, cfg)
    out: dict[str, Any] = {"seconds": seconds, "peaks": peaks, "cpu": cpu, "overhead": _overhead(cfg, world)}
    dist.barrier()
    if rank == 0:
        out["counting"] = counting_cost(max(3, cfg.overhead_steps))
        out["profiles"] = {k: p.to_dict() for k, p in profiles.items()}
        out["link"] = {"latency_s": link.latency, "bandwidth": link.bandwidth, "message_bytes": message}
        out["calibration"] = calibration
        out["in_pipeline"] = in_pipeline
        out["plans"] = [{"row": c.result.best.to_dict(), "groups": list(c.groups), "cpu_model": _model_cpu(c, cfg),
                         "cpu_previous": _model_cpu(variants["previous"][i], cfg),
                         "variants": {k: {"step_s": v[i].result.best.step_s, "groups": list(v[i].groups)}
                                      for k, v in variants.items()}}
                        for i, c in enumerate(choices)]
    dist.barrier()
    return out


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else float("inf")


def summarize(per_rank: list[dict[str, Any]], cfg: PvMConfig) -> list[dict[str, Any]]:
    """One row per candidate: predicted vs measured step time and peak activation bytes (max over ranks)."""
    lead = per_rank[0]
    rows = []
    for c, plan_row in enumerate(lead["plans"]):
        row = plan_row["row"]
        samples = lead["seconds"][c]
        predicted_acts = [m["activations"] for m in row["per_rank"]]
        measured_acts = [max(r["peaks"][c]) for r in per_rank]
        stable = all(len(set(r["peaks"][c])) == 1 for r in per_rank)
        step = harness.summarize(samples)
        variants = {k: dict(v, err=_rel(step.median, v["step_s"])) for k, v in plan_row["variants"].items()}
        cpu = [r["cpu"][c] for r in per_rank]
        rows.append({
            "candidate": f"{row['schedule']}, M={row['microbatches']}", "groups": plan_row["groups"],
            "predicted_s": row["step_s"], "variants": variants, "cpu_model": plan_row["cpu_model"], "cpu": cpu,
            "cpu_previous": plan_row["cpu_previous"],
            "measured": step.to_dict(), "min_s": min(samples), "max_s": max(samples), "samples": samples,
            "time_err": _rel(step.median, row["step_s"]),
            "predicted_acts": predicted_acts, "measured_acts": measured_acts, "peaks_stable": stable,
            "bytes_err": _rel(max(measured_acts), max(predicted_acts)),
            "bytes_err_per_rank": max(abs(_rel(m, p)) for m, p in zip(measured_acts, predicted_acts, strict=True)),
        })
    return rows


def order_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of candidates whose predicted step times differ by more than ORDER_GAP, and whether the
    measured medians order them the same way."""
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
    rows = summarize(per_rank, cfg)
    on, off = per_rank[0]["overhead"]["on"], per_rank[0]["overhead"]["off"]
    overhead = {"on": harness.summarize(on).to_dict(), "off": harness.summarize(off).to_dict(),
                "paired_ratio": statistics.median(a / b for a, b in zip(on, off, strict=True))}
    lead = per_rank[0]
    return {"rows": rows, "order": order_pairs(rows), "overhead": overhead, "counting": lead["counting"],
            "link": lead["link"], "profiles": lead["profiles"], "calibration": lead["calibration"],
            "in_pipeline": lead["in_pipeline"],
            "variants": dict(VARIANTS), "config": asdict(cfg)}


PART = Part("plan_vs_measured", "Planner predictions vs measurement", PvMConfig(), QUICK, run, report, figures,
            block="plan-vs-measured")

if __name__ == "__main__":
    raise SystemExit(main(only=PART.name))
