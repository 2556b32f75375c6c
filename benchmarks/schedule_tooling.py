"""Part: the schedule passes' time (build, lower, verify, simulate) as P and M grow, and torch's plan construction."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

from benchmarks import runner
from benchmarks.framework import Block, Part, Result, figure, mark, ms
from benchmarks.internals import check_schedule
from duplexpipe import CostModel, build_schedule, lower, simulate, verify

BUDGET_S = 1.0  # the headline case's build + lower + verify + simulate, at most (docs/design.md)
TORCH_SPEEDUP = 2.0  # torch's plan construction over ours (build + lower) at P=16, M=256, at least
BIG = 64 * 1024  # cases with P * M at least this many stage-microbatches run once (each takes seconds)
CLI_CASES = MappingProxyType({
    "simulate-1f1b-P2048": ("simulate", "1f1b", "-p", "2048", "-m", "8", "--json"),
    "simulate-1f1b-P10000": ("simulate", "1f1b", "-p", "10000", "-m", "8", "--json"),
    "plot-dualpipe-P64-M512": ("simulate", "dualpipe", "-p", "64", "-m", "512", "--plot", "{out}/dp.png"),
    "plot-dualpipe-P64-M512-view": ("simulate", "dualpipe", "-p", "64", "-m", "512", "--plot", "{out}/v.png",
                                    "--ranks-shown", "0-7,56-63", "--window", "0:200"),
    "compare-P64-M512-plot": ("compare", "-p", "64", "-m", "512", "--plot", "{out}/cmp.png"),
})  # name -> the arguments after `duplexpipe` (`{out}` becomes a scratch folder)
PROGRAM = ("import resource, sys; from duplexpipe.cli import main; rc = main(sys.argv[1:]); "
           "u = resource.getrusage(resource.RUSAGE_SELF); "
           "print(f'@@ {u.ru_utime + u.ru_stime} {u.ru_maxrss}', file=sys.stderr); sys.exit(rc)")


@dataclass(frozen=True)
class ToolingConfig:
    """What one run times."""

    headline: tuple[str, int, int] = ("dualpipe", 64, 512)  # (schedule, P, M) timed first, against the budget
    headline_repeats: int = 5  # runs of the headline case (the median is reported)
    torch: tuple[tuple[str, str, int, int], ...] = (
        ("dualpipev", "DualPipeV", 16, 256), ("dualpipev", "DualPipeV", 8, 64), ("zbv", "ZBVZeroBubble", 16, 256),
        ("interleaved-1f1b", "Interleaved1F1B", 16, 256))  # (our name, torch's, P, M) of the plan construction
    schedules: tuple[str, ...] = ("1f1b", "zbv", "dualpipe", "dualpipev")  # schedules of the scaling table
    ranks: tuple[int, ...] = (8, 16, 32, 64, 128)  # P values of the scaling table
    microbatches: tuple[int, ...] = (256, 1024)  # M values of the scaling table
    repeats: int = 1  # runs per case of the table and of the torch comparison (medians are reported)
    cli: tuple[str, ...] = ()  # CLI_CASES to run instead (the `duplexpipe` command's time and peak memory at scale)
    cli_source: str = str(runner.ROOT)  # the folder of the duplexpipe the CLI cases run (another checkout: A/B)


QUICK = ToolingConfig(("dualpipe", 8, 64), 1, (("dualpipev", "DualPipeV", 4, 16),), ("1f1b", "dualpipe"), (4, 8),
                      (16, 64))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def time_passes(name: str, ranks: int, microbatches: int, repeats: int) -> dict[str, Any]:
    """Median seconds of each pass over `repeats` runs, each pass on the previous one's output."""
    runs = []
    for _ in range(repeats):
        schedule, t_build = _timed(partial(build_schedule, name, ranks, microbatches))
        lowered, t_lower = _timed(partial(lower, schedule))
        runs.append((t_build, t_lower, _timed(partial(verify, lowered))[1],
                     _timed(partial(simulate, lowered, CostModel(fb=3.0)))[1]))
    passes = zip(("build_s", "lower_s", "verify_s", "simulate_s"), zip(*runs, strict=True), strict=True)
    return {"schedule": name, "P": ranks, "M": microbatches, "actions": sum(len(row) for row in lowered.actions),
            "repeats": repeats, **{key: statistics.median(values) for key, values in passes},
            "total_s": statistics.median(map(sum, runs))}


def time_torch(ours: str, theirs: str, ranks: int, microbatches: int, repeats: int) -> dict[str, Any]:
    """Ours (build + lower) against torch's get_schedule_ops(..., with_comms=True), medians."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    mine = statistics.median(_timed(lambda: lower(build_schedule(ours, ranks, microbatches)))[1]
                             for _ in range(repeats))
    torch_s = statistics.median(_timed(lambda: get_schedule_ops(theirs, ranks, microbatches, with_comms=True))[1]
                                for _ in range(repeats))
    return {"schedule": ours, "torch_schedule": theirs, "P": ranks, "M": microbatches, "repeats": repeats,
            "ours_build_lower_s": mine, "torch_get_schedule_ops_s": torch_s,
            "speedup": torch_s / mine if mine > 0 else None}


def measure_cli(argv: tuple[str, ...], source: str, out: str, timeout_s: float) -> dict[str, float]:
    """One case in a fresh process: exit code, wall seconds, and CPU seconds and peak RSS from its getrusage."""
    cmd = [sys.executable, "-c", PROGRAM, *(a.replace("{out}", out) for a in argv)]
    proc, wall = _timed(partial(subprocess.run, cmd, env=dict(os.environ, PYTHONPATH=source, MPLBACKEND="Agg"),
                                capture_output=True, text=True, timeout=timeout_s, check=False, cwd=out))
    stats = [line.split() for line in proc.stderr.splitlines() if line.startswith("@@ ")]
    cpu, rss = (float(stats[-1][1]), float(stats[-1][2])) if stats else (float("nan"), float("nan"))
    return {"exit_code": proc.returncode, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss / 1024}


def run(cfg: ToolingConfig) -> Result:
    """The headline case, the torch comparison and the scaling grid; or the CLI cases, each in a fresh process."""
    if cfg.cli:
        with tempfile.TemporaryDirectory() as out:
            return {"source": cfg.cli_source, "cli": [{"name": name, **measure_cli(
                CLI_CASES[name], os.path.abspath(cfg.cli_source), out, 900.0)} for name in cfg.cli]}
    rows = [time_passes(name, p, m, 1 if p * m >= BIG else cfg.repeats) for name in cfg.schedules
            for p in cfg.ranks for m in cfg.microbatches if check_schedule(name, p, m) is None]
    return {"headline": time_passes(*cfg.headline, cfg.headline_repeats), "rows": rows,
            "vs_torch": [time_torch(*case, cfg.repeats) for case in cfg.torch]}


def report(result: Result) -> list[Block]:
    """The headline against its budget, the scaling table, the torch comparison (or the CLI cases)."""
    if "cli" in result:
        return [f"The `duplexpipe` command of {result['source']}:", [["case", "exit", "wall s", "cpu s", "peak MB"]] +
                [[r["name"], str(r["exit_code"]), f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['peak_rss_mb']:.0f}"]
                 for r in result["cli"]]]
    h = result["headline"]
    verdict = "meets" if h["total_s"] < BUDGET_S else "MISSES"
    return [[["schedule", "P", "M", "actions", "build ms", "lower ms", "verify ms", "simulate ms", "total ms"]] + [
                [r["schedule"] + (" (headline)" if r is h else ""), str(r["P"]), str(r["M"]), str(r["actions"]),
                 *(ms(r[k]) for k in ("build_s", "lower_s", "verify_s", "simulate_s", "total_s"))]
                for r in [h, *result["rows"]]],
            f"{h['schedule']} P={h['P']} M={h['M']}: build+lower+verify+simulate {h['total_s'] * 1e3:.0f} ms "
            f"(median of {h['repeats']}), {verdict} the {BUDGET_S:g} s budget.",
            "### Plan construction: duplexpipe build + lower vs torch",
            [["schedule", "torch class", "P", "M", "ours build+lower ms", "torch plan ms", "torch/ours", "met"]] + [
                [r["schedule"], r["torch_schedule"], str(r["P"]), str(r["M"]), ms(r["ours_build_lower_s"]),
                 ms(r["torch_get_schedule_ops_s"]), f"{r['speedup']:.1f}x",
                 mark(r["speedup"] >= TORCH_SPEEDUP) if (r["P"], r["M"]) == (16, 256) else "-"]
                for r in result["vs_torch"]]]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Total time against P (log-log), a line per (schedule, M); torch's plan construction as crosses."""
    if "cli" in result:
        return []
    fig = figure(8.0, 4.4)
    ax = fig.subplots()
    rows = result["rows"]
    for c, name in enumerate(dict.fromkeys(r["schedule"] for r in rows)):
        for k, m in enumerate(sorted({r["M"] for r in rows if r["schedule"] == name})):
            mine = sorted((r for r in rows if r["schedule"] == name and r["M"] == m), key=lambda r: r["P"])
            ax.plot([r["P"] for r in mine], [r["total_s"] for r in mine], marker="o" if k == 0 else "s",
                    linestyle="-" if k == 0 else "--", color=f"C{c}", label=f"{name}, M={m}")
    head = result["headline"]
    ax.plot([head["P"]], [head["total_s"]], marker="*", markersize=12, color="black", linestyle="none",
            label=f"headline {head['schedule']} P={head['P']} M={head['M']}")
    for k, r in enumerate(result["vs_torch"]):
        ax.plot([r["P"]], [r["torch_get_schedule_ops_s"]], marker="x", markersize=8, linestyle="none", color="#c0392b",
                label="torch plan construction (vs our build+lower: its table)" if k == 0 else None)
    ax.axhline(BUDGET_S, color="#c0392b", linestyle=":", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="ranks P", ylabel="seconds")
    ax.set_xscale("log", base=2)
    ax.set_title("Schedule tooling: build + lower + verify + simulate", fontsize=10)
    ax.legend(fontsize=6.5, ncols=2)
    fig.savefig(os.path.join(folder, "bench_tooling.png"))
    return [("bench_tooling.png", "Schedule tooling time against P")]


PART = Part("schedule_tooling", "Schedule tooling scaling: build + lower + verify + simulate", ToolingConfig(), QUICK,
            run, report, figures, block="schedule-tooling")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
