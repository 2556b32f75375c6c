"""schedule="auto" on the user path against hand-picked schedules, on MLPs the planner never saw.

One spawn of 4 gloo processes (one thread each; the machine's cores shared, `schedule_options={"cores": C}`)
builds, per model, `Pipeline.from_layers(..., PipelineConfig(schedule="auto", schedule_options={"cores": C}))`
exactly as a user would (it profiles on rank 0, calibrates the runtime in the pipeline, plans, logs), then the
schedules a user would pick by hand (1F1B, GPipe, interleaved 1F1B with 2 chunks, ZB-H1, ZBV, DualPipeV at
M in {4, 8, 16}, the layers split with `balance="time"`), and steps them all in turn (step i of each, the first
one rotating) so every candidate sees the same machine. The models: an MLP with uneven layer widths and a
heavy head (a wide output layer and cross-entropy), once compute-bound (about 100+ ms per step) and once
overhead-bound (about 10 ms per step). The auto Pipeline's calibration cache is a fresh directory per run
(the measurement is part of what is judged).

Targets (issue 22): auto's predicted step within 25% of its measured step, and its measured step no more than
5% slower than the best hand-picked schedule, on both models. The best of 17 noisy medians is biased low
(picked on the same samples it is judged on), so after the sweep auto and the best hand-picked schedule run
head to head on fresh steps (`confirm` rounds, the order alternating): the pick is judged on the median of
the rounds' ratios; the sweep's own ratio is reported beside it.

Usage: python benchmarks/auto_vs_hand.py [--quick] [--out DIR] [--docs DIR|none] [--load-note TEXT]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness, report  # noqa: E402
from duplexpipe.pipeline import Pipeline, PipelineConfig  # noqa: E402
from duplexpipe.planner.plan import plan  # noqa: E402
from duplexpipe.schedules import registry  # noqa: E402

HAND = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
"""The schedules a user would pick by hand (interleaved with 2 chunks)."""
SECTION = "auto-vs-hand"
"""The marker name of this benchmark's block in docs/benchmarks.md."""


@dataclass(frozen=True)
class MLPSpec:
    """An MLP with uneven layer widths and a heavy head, on random features and class targets."""

    name: str
    """What the workload is called in the report."""
    widths: tuple[int, ...]
    """Feature widths: layer k maps widths[k] to widths[k + 1] (then GELU)."""
    classes: int
    """The head's outputs (a Linear to this many classes, then cross-entropy)."""
    batch: int
    """Samples per step."""
    seed: int = 0
    """Seed of the weights and the data."""


@dataclass(frozen=True)
class AutoBenchConfig:
    """What one run measures."""

    ranks: int = 4
    """Pipeline ranks (gloo processes)."""
    cores: int = 2
    """The cores the ranks share (schedule_options["cores"])."""
    models: tuple[MLPSpec, ...] = (
        MLPSpec("compute-bound", (384, 768, 512, 1024, 640, 1024, 512, 768, 512, 1024, 512, 768, 640), 6144, 256),
        MLPSpec("overhead-bound", (64, 128, 96, 192, 64, 160, 96, 128, 80, 192, 64, 128, 96), 1024, 16),
    )
    """The workloads."""
    microbatches: tuple[int, ...] = (4, 8, 16)
    """M of the hand-picked schedules."""
    schedules: tuple[str, ...] = HAND
    """The hand-picked schedules."""
    steps: int = 20
    """Measured steps of every candidate."""
    warmup: int = 2
    """Unmeasured steps of every candidate first."""
    confirm: int = 30
    """Head-to-head rounds of auto and the sweep's best hand-picked schedule (0: none)."""


def quick_config() -> AutoBenchConfig:
    """A smoke configuration: 2 ranks, a tiny overhead-bound model, two hand-picked schedules, 2 steps."""
    tiny = MLPSpec("overhead-bound", (16, 32, 24, 32, 16), 64, 8)
    return AutoBenchConfig(ranks=2, cores=2, models=(tiny,), microbatches=(4,), schedules=("1f1b", "zb-h1"),
                           steps=2, warmup=1, confirm=2)


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


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _flags() -> dict[str, Any]:
    """The runtime flags every measured Pipeline uses (auto's calibration runs with the same)."""
    return {"record_timeline": False, "check_inputs_every_step": False}


def _hand(spec: MLPSpec, cfg: AutoBenchConfig) -> list[tuple[str, int]]:
    """The hand-picked (schedule, M) pairs the registry accepts on cfg.ranks."""
    pairs = []
    for name in cfg.schedules:
        options = {"chunks": 2} if name == "interleaved-1f1b" else {}
        for m in cfg.microbatches:
            if spec.batch % m == 0 and registry.check(name, cfg.ranks, m, **options) is None:
                pairs.append((name, m))
    return pairs


def _pipelines(spec: MLPSpec, cfg: AutoBenchConfig, cache: str) -> tuple[list[str], list[Pipeline], list[float]]:
    """Auto's Pipeline (built as a user would, twice: measured, then from the cache) first, then the hand-picked
    ones; and auto's two construction times (seconds)."""
    layers, head = build_model(spec)
    x, y = make_batch(spec)
    loss = nn.functional.cross_entropy
    times = []
    for _ in range(2):  # measured, then again from the cache
        started = time.perf_counter()
        auto = Pipeline.from_layers(copy.deepcopy(layers), loss, _adamw, PipelineConfig(
            schedule="auto", schedule_options={"cores": cfg.cores, "calibration_cache": cache}, **_flags()),
            head=copy.deepcopy(head), sample_input=x, sample_targets=y)
        times.append(time.perf_counter() - started)
    names, pipes = ["auto"], [auto]
    for name, m in _hand(spec, cfg):
        options = {"chunks": 2} if name == "interleaved-1f1b" else {}
        pipes.append(Pipeline.from_layers(copy.deepcopy(layers), loss, _adamw, PipelineConfig(
            schedule=name, num_microbatches=m, schedule_options=options, **_flags()), head=copy.deepcopy(head),
            balance="time", sample_input=x[: spec.batch // m]))
        names.append(f"{name}{'(chunks=2)' if options else ''}, M={m}")
    return names, pipes, times


def _measure(spec: MLPSpec, cfg: AutoBenchConfig, cache: str) -> dict[str, Any]:
    """Every candidate stepped in turn; per candidate the slowest rank's seconds of each measured step."""
    names, pipes, built = _pipelines(spec, cfg, cache)
    x, y = make_batch(spec)
    seconds: list[list[float]] = [[] for _ in pipes]
    for step in range(cfg.warmup + cfg.steps):
        for k in range(len(pipes)):
            c = (step + k) % len(pipes)
            took, _ = harness.timed(lambda c=c: pipes[c].step(x, y))  # type: ignore[misc]
            if step >= cfg.warmup:
                seconds[c].append(took)
    confirm = _head_to_head(pipes, seconds, cfg.confirm, x, y)
    auto = pipes[0]
    assert auto.auto is not None
    overhead = auto.auto.profile.overhead
    planned = auto.auto.result.config
    predicted = [auto.plan.predicted_step_s] + [
        plan(auto.auto.profile, replace(planned, schedules=(name,), microbatches=(m,), chunks=(2,))).best.step_s
        for name, m in _hand(spec, cfg)]
    return {"names": names, "seconds": seconds, "confirm": confirm, "auto_build_s": built[0],
            "auto_cached_build_s": built[1],
            "plan": auto.plan.summary(),
            "predicted_s": auto.plan.predicted_step_s, "source": auto.auto.source,
            "overhead": overhead.to_dict() if overhead is not None else None,
            "table": auto.auto.result.table(8), "profile": auto.auto.profile.to_dict(), "predicted": predicted}


def _head_to_head(pipes: list[Pipeline], seconds: list[list[float]], rounds: int, x: torch.Tensor,
                  y: torch.Tensor) -> dict[str, Any]:
    """Auto (pipes[0]) and the sweep's best hand-picked pipeline, a step of each per round (which goes first
    alternates): their seconds per round (every rank has the same sweep samples, so the same rival)."""
    medians = [harness.summarize(s).median for s in seconds[1:]]
    rival = 1 + min(range(len(medians)), key=medians.__getitem__)
    out: dict[str, Any] = {"rival": rival, "auto": [], "hand": []}
    for r in range(rounds):
        for c in (0, rival) if r % 2 == 0 else (rival, 0):
            took, _ = harness.timed(lambda c=c: pipes[c].step(x, y))  # type: ignore[misc]
            out["auto" if c == 0 else "hand"].append(took)
    return out


def _worker(rank: int, world: int, cfg: AutoBenchConfig) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for spec in cfg.models:
        with tempfile.TemporaryDirectory() as cache:
            out.append({"model": asdict(spec), **_measure(spec, cfg, cache)})
    return out


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Medians, auto's prediction error, its rank and its ratio to the best hand-picked candidate: in the sweep
    and, when run, head to head (the median of the rounds' auto / hand ratios, which judges the pick)."""
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


def run(cfg: AutoBenchConfig) -> dict[str, Any]:
    """Measure every model; per model the summary, the plan and the raw samples."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    lead = harness.spawn(_worker, cfg, world=cfg.ranks, timeout_s=3600)[0]
    return {"models": [{**m, **summarize(m)} for m in lead], "config": asdict(cfg)}


def text_report(part: dict[str, Any]) -> str:
    """The tables of a run."""
    lines = []
    for m in part["models"]:
        spec = m["model"]
        lines.append(f"{spec['name']}: widths {spec['widths']}, head {spec['widths'][-1]} -> {spec['classes']} "
                     f"classes, batch {spec['batch']}")
        lines.append(f"  auto chose {m['plan']}; built in {m['auto_build_s']:.1f} s measuring, "
                     f"{m['auto_cached_build_s']:.1f} s from the cache; {m['source'].split('; ', 1)[-1]}")
        lines.append(f"  auto measured {m['auto_s'] * 1e3:.1f} ms vs predicted {m['predicted_s'] * 1e3:.1f} ms "
                     f"({m['error']:+.1%}, target 25%: {'met' if m['predicted_ok'] else 'NOT met'}); rank "
                     f"{m['rank']} of {m['candidates']}; best hand-picked {m['best_hand']} "
                     f"{m['best_hand_s'] * 1e3:.1f} ms, auto / best {_ratios(m)} (target <= 1.05: "
                     f"{'met' if m['pick_ok'] else 'NOT met'})")
        for row in m["rows"]:
            lines.append(f"    {row['candidate']:<32} {row['median_s'] * 1e3:8.1f} ms  "
                         f"(IQR {row['q1_s'] * 1e3:.1f}-{row['q3_s'] * 1e3:.1f})  planner "
                         f"{row['predicted_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def _ratios(m: dict[str, Any]) -> str:
    """Auto / best hand-picked in the sweep and, when run, head to head (the one the target judges)."""
    if not m.get("confirmed"):
        return f"{m['ratio']:.3f} (sweep)"
    return f"{m['sweep_ratio']:.3f} sweep, {m['ratio']:.3f} head to head ({len(m['confirm']['auto'])} rounds)"


def markdown(part: dict[str, Any]) -> str:
    """The docs block of a run."""
    meta = part.get("meta", {})
    lines = [f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}` ({meta.get('wall_s', 0):.0f} s wall); "
             f"load average before / after: {meta.get('load_before')} / {meta.get('load_after')}. "
             f"{meta.get('load_note', '')}", "",
             "| model | auto's plan | predicted ms | measured ms | error | met (25%) | best hand-picked | ms | "
             "auto / best: sweep, head to head | rank | met (5%) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in part["models"]:
        lines.append(f"| {m['model']['name']} | {m['plan']} | {m['predicted_s'] * 1e3:.1f} | {m['auto_s'] * 1e3:.1f} | "
                     f"{m['error']:+.1%} | {'yes' if m['predicted_ok'] else 'no'} | {m['best_hand']} | "
                     f"{m['best_hand_s'] * 1e3:.1f} | {_ratios(m)} | {m['rank']} of {m['candidates']} | "
                     f"{'yes' if m['pick_ok'] else 'no'} |")
    for m in part["models"]:
        o, spec = m["overhead"], m["model"]
        terms = "no in-pipeline fit" if o is None else (
            f"compute scale {o['compute_scale']:.3g}, {o['action_s'] * 1e6:.0f} us per compute action, "
            f"{o['message_s'] * 1e6:.0f} us per SEND/RECV, {o['step_s'] * 1e3:.3g} ms per step")
        lines += ["", f"**{spec['name']}** (widths {list(spec['widths'])}, head {spec['widths'][-1]} -> "
                  f"{spec['classes']} classes, batch {spec['batch']}): auto's Pipeline built in "
                  f"{m['auto_build_s']:.1f} s measuring (profile, calibration, plan), {m['auto_cached_build_s']:.1f} s "
                  f"from the cache; calibrated {terms}; {m['source'].split('; ', 1)[-1]}.", "",
                  f"{spec['name']}: median ms per candidate (IQR)", "",
                  "| candidate | median ms | IQR ms | the planner's prediction ms (its own grouping of the parts) |",
                  "|---|---|---|---|"]
        lines += [f"| {r['candidate']} | {r['median_s'] * 1e3:.1f} | {r['q1_s'] * 1e3:.1f}-{r['q3_s'] * 1e3:.1f} | "
                  f"{r['predicted_s'] * 1e3:.1f} |" for r in m["rows"]]
    return "\n".join(lines)


def measure(cfg: AutoBenchConfig, command: str, load_note: str) -> dict[str, Any]:
    """run() with the machine's load and the command recorded."""
    load_before, started = [round(x, 2) for x in os.getloadavg()], time.monotonic()
    part = run(cfg)
    part["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.monotonic() - started,
                    "command": command, "uptime": harness.uptime(), "load_before": load_before,
                    "load_after": [round(x, 2) for x in os.getloadavg()], "load_note": load_note,
                    "machine": harness.machine_info()}
    return part


def publish(part: dict[str, Any], docs: str) -> None:
    """Rewrite this benchmark's block of docs/benchmarks.md."""
    report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(part), f"<!-- bench:{SECTION}:begin -->",
                      f"<!-- bench:{SECTION}:end -->")


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write OUT/auto_vs_hand.json and (unless --docs none) the docs block."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, a tiny model, 2 hand-picked schedules")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench-output"), help="results directory")
    parser.add_argument("--docs", default=os.path.join(ROOT, "docs"), help="docs directory to update; 'none' to skip")
    parser.add_argument("--load-note", default="", help="how loaded the machine was, for the docs")
    args = parser.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    if "--load-note" in given:
        given[given.index("--load-note") + 1] = "NOTE"
    part = measure(quick_config() if args.quick else AutoBenchConfig(),
                   shlex.join(["python", "benchmarks/auto_vs_hand.py", *given]), args.load_note)
    report.write_json(part, os.path.join(args.out, "auto_vs_hand.json"))
    print(text_report(part))
    if args.docs != "none":
        publish(part, args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
