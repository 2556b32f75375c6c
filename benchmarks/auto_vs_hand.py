"""Part: schedule="auto" on the user path against hand-picked schedules, on MLPs the planner never saw."""

from __future__ import annotations

import copy
import itertools
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, ms
from benchmarks.internals import check_schedule
from duplexpipe import Pipeline, PipelineConfig, plan
from duplexpipe.train.pipeline_config import ObserveConfig, SafetyConfig

HAND = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")  # picked by hand (interleaved: 2 chunks)


@dataclass(frozen=True)
class MLPSpec:
    """An MLP with uneven layer widths and a heavy head, on random features and class targets."""

    name: str  # what the workload is called in the report
    widths: tuple[int, ...]  # feature widths: layer k maps widths[k] to widths[k + 1] (then GELU)
    classes: int  # the head's outputs (a Linear to this many classes, then cross-entropy)
    batch: int  # samples per step
    seed: int = 0  # seed of the weights and the data


@dataclass(frozen=True)
class AutoBenchConfig:
    """Per model, schedule="auto" built as a user would and every hand-picked (schedule, M), stepped in turn.
    Targets: auto's prediction within 25% of its step, auto no more than 5% slower than the best hand-picked one."""

    ranks: int = 4  # pipeline ranks (gloo processes)
    cores: int = 2  # the cores the ranks share (schedule_options["cores"])
    models: tuple[MLPSpec, ...] = (
        MLPSpec("compute-bound", (384, 768, 512, 1024, 640, 1024, 512, 768, 512, 1024, 512, 768, 640), 6144, 256),
        MLPSpec("overhead-bound", (64, 128, 96, 192, 64, 160, 96, 128, 80, 192, 64, 128, 96), 1024, 16),
    )
    microbatches: tuple[int, ...] = (4, 8, 16)  # M of the hand-picked schedules
    schedules: tuple[str, ...] = HAND  # the hand-picked schedules
    steps: int = 20  # measured steps of every candidate
    warmup: int = 2  # unmeasured steps of every candidate first
    confirm: int = 30  # head-to-head rounds of auto and the sweep's best (0: none): the pick is judged on these


QUICK = AutoBenchConfig(ranks=2, cores=2, models=(MLPSpec("overhead-bound", (16, 32, 24, 32, 16), 64, 8),),
                        microbatches=(4,), schedules=("1f1b", "zb-h1"), steps=2, warmup=1, confirm=2)


def build_model(spec: MLPSpec) -> tuple[list[nn.Module], nn.Module]:
    """The layers and the head, identical on every process."""
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in itertools.pairwise(spec.widths)]
    return layers, nn.Linear(spec.widths[-1], spec.classes)


def make_batch(spec: MLPSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, class ids) of one step, the same on every process."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    return (torch.randn(spec.batch, spec.widths[0], generator=gen),
            torch.randint(0, spec.classes, (spec.batch,), generator=gen))


def _hand(spec: MLPSpec, cfg: AutoBenchConfig) -> list[tuple[str, int]]:
    """The hand-picked (schedule, M) pairs the registry accepts on cfg.ranks."""
    return [(name, m) for name in cfg.schedules for m in cfg.microbatches if spec.batch % m == 0 and check_schedule(
        name, cfg.ranks, m, **({"chunks": 2} if name == "interleaved-1f1b" else {})) is None]


def _pipelines(spec: MLPSpec, cfg: AutoBenchConfig, cache: str) -> tuple[list[str], list[Pipeline], list[float]]:
    """Auto's Pipeline (built twice: measured, then from the cache), the hand-picked ones; auto's build seconds."""
    layers, head = build_model(spec)
    x, y = make_batch(spec)
    loss, adamw = nn.functional.cross_entropy, harness.adamw(1e-3)
    flags: Any = {"observe": ObserveConfig(record_timeline=False),
                  "safety": SafetyConfig(check_inputs_every_step=False)}  # auto's calibration runs with the same
    times = []
    for _ in range(2):  # measured, then again from the cache
        started = time.perf_counter()
        auto = Pipeline.from_layers(copy.deepcopy(layers), loss, adamw, PipelineConfig(
            schedule="auto", schedule_options={"cores": cfg.cores, "calibration_cache": cache}, **flags),
            head=copy.deepcopy(head), sample_input=x, sample_targets=y)
        times.append(time.perf_counter() - started)
    names, pipes = ["auto"], [auto]
    for name, m in _hand(spec, cfg):
        options = {"chunks": 2} if name == "interleaved-1f1b" else {}
        pipes.append(Pipeline.from_layers(copy.deepcopy(layers), loss, adamw, PipelineConfig(
            schedule=name, num_microbatches=m, schedule_options=options, **flags), head=copy.deepcopy(head),
            balance="time", sample_input=x[: spec.batch // m]))
        names.append(f"{name}{'(chunks=2)' if options else ''}, M={m}")
    return names, pipes, times


def _measure(spec: MLPSpec, cfg: AutoBenchConfig, cache: str) -> dict[str, Any]:
    """Every candidate stepped in turn, then auto head to head with the sweep's best hand-picked one."""
    names, pipes, built = _pipelines(spec, cfg, cache)
    x, y = make_batch(spec)
    seconds = [t.wall for t in harness.RoundRobin(pipes, lambda p, _: p.step(x, y)).run(cfg.steps, cfg.warmup)]
    medians = [statistics.median(s) for s in seconds[1:]]
    rival = 1 + min(range(len(medians)), key=medians.__getitem__)
    rounds = harness.RoundRobin([pipes[0], pipes[rival]], lambda p, _: p.step(x, y)).run(cfg.confirm)
    auto, chosen = pipes[0].auto, pipes[0].plan
    assert auto is not None
    predicted = [chosen.predicted_step_s] + [
        plan(auto.profile, replace(auto.result.config, schedules=(name,), microbatches=(m,), chunks=(2,))).best.step_s
        for name, m in _hand(spec, cfg)]
    return {"names": names, "seconds": seconds, "auto_build_s": built[0], "auto_cached_build_s": built[1],
            "confirm": {"rival": rival, "auto": rounds[0].wall, "hand": rounds[1].wall}, "plan": chosen.summary(),
            "predicted_s": chosen.predicted_step_s, "source": auto.source, "table": auto.result.table(8),
            "overhead": auto.profile.overhead.to_dict() if auto.profile.overhead is not None else None,
            "profile": auto.profile.to_dict(), "predicted": predicted}


def _worker(rank: int, world: int, cfg: AutoBenchConfig) -> list[dict[str, Any]]:
    out = []
    for spec in cfg.models:
        with tempfile.TemporaryDirectory() as cache:
            out.append({"model": asdict(spec), **_measure(spec, cfg, cache)})
    return out


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Medians, auto's prediction error, rank and ratio to the best hand-picked one (sweep, head to head)."""
    medians = [harness.summarize(s).median for s in measured["seconds"]]
    rows = [{"candidate": n, "predicted_s": p, **harness.summarize(s).to_dict()}
            for n, s, p in zip(measured["names"], measured["seconds"], measured["predicted"], strict=True)]
    auto, hand = medians[0], medians[1:]
    best = min(range(len(hand)), key=hand.__getitem__)
    predicted = measured["predicted_s"]
    ratio = sweep = auto / hand[best]
    confirm = measured.get("confirm")
    if confirm and confirm["auto"]:
        ratio = statistics.median(a / h for a, h in zip(confirm["auto"], confirm["hand"], strict=True))
    return {"rows": rows, "auto_s": auto, "predicted_s": predicted, "error": auto / predicted - 1,
            "best_hand": measured["names"][best + 1], "best_hand_s": hand[best], "sweep_ratio": sweep,
            "ratio": ratio, "confirmed": bool(confirm and confirm["auto"]),
            "rank": 1 + sum(m < auto for m in hand), "candidates": len(medians),
            "predicted_ok": abs(auto / predicted - 1) <= 0.25, "pick_ok": ratio <= 1.05}


def _ratios(m: dict[str, Any]) -> str:
    """Auto / best hand-picked in the sweep and, when run, head to head (the one the target judges)."""
    return (f"{m['sweep_ratio']:.3f} sweep, {m['ratio']:.3f} head to head ({len(m['confirm']['auto'])} rounds)"
            if m.get("confirmed") else f"{m['ratio']:.3f} (sweep)")


def run(cfg: AutoBenchConfig) -> Result:
    """Measure every model; per model the summary, the plan and the raw samples."""
    lead = harness.spawn(_worker, cfg, cfg.ranks, 3600)[0]
    return {"models": [{**m, **summarize(m)} for m in lead], "config": asdict(cfg)}


def report(result: Result) -> list[Block]:
    """The verdict per model, then per model how auto was built and every candidate's median."""
    out: list[Block] = [[["model", "auto's plan", "predicted ms", "measured ms", "error", "met (25%)",
                          "best hand-picked", "ms", "auto / best: sweep, head to head", "rank", "met (5%)"]] + [
        [m["model"]["name"], m["plan"], ms(m["predicted_s"]), ms(m["auto_s"]), f"{m['error']:+.1%}",
         "yes" if m["predicted_ok"] else "no", m["best_hand"], ms(m["best_hand_s"]), _ratios(m),
         f"{m['rank']} of {m['candidates']}", "yes" if m["pick_ok"] else "no"] for m in result["models"]]]
    for m in result["models"]:
        o, spec = m["overhead"], m["model"]
        terms = "no in-pipeline fit" if o is None else (
            f"compute scale {o['compute_scale']:.3g}, {o['action_s'] * 1e6:.0f} us per compute action, "
            f"{o['message_s'] * 1e6:.0f} us per SEND/RECV, {o['step_s'] * 1e3:.3g} ms per step")
        out += [f"**{spec['name']}** (widths {list(spec['widths'])}, head {spec['widths'][-1]} -> {spec['classes']} "
                f"classes, batch {spec['batch']}): auto's Pipeline built in {m['auto_build_s']:.1f} s measuring "
                f"(profile, calibration, plan), {m['auto_cached_build_s']:.1f} s from the cache; calibrated {terms}; "
                f"{m['source'].split('; ', 1)[-1]}. Median ms per candidate (IQR):",
                [["candidate", "median ms", "IQR ms", "the planner's prediction ms (its own grouping of the parts)"]] +
                [[r["candidate"], ms(r["median_s"]), f"{ms(r['q1_s'])}-{ms(r['q3_s'])}", ms(r["predicted_s"])]
                 for r in m["rows"]]]
    return out


PART = Part("auto_vs_hand", "schedule='auto' against hand-picked schedules", AutoBenchConfig(), QUICK, run, report,
            block="auto-vs-hand")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
