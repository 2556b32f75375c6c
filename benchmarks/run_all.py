"""`make bench`: every duplexpipe benchmark in one run, with a table, results.json, docs and figures."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import figures, harness, report  # noqa: E402
from benchmarks.auto_vs_hand import AutoBenchConfig  # noqa: E402
from benchmarks.auto_vs_hand import quick_config as auto_quick_config  # noqa: E402
from benchmarks.dp_compression import DPBenchConfig  # noqa: E402
from benchmarks.measured_vs_sim import SimConfig  # noqa: E402
from benchmarks.models import ModelSpec  # noqa: E402
from benchmarks.moe_overlap import MoEBenchConfig  # noqa: E402
from benchmarks.overlap import OverlapConfig  # noqa: E402
from benchmarks.p2p_compression import P2PConfig, quick_config  # noqa: E402
from benchmarks.plan_vs_measured import PvMConfig  # noqa: E402
from benchmarks.plan_vs_measured import quick_config as pvm_quick_config  # noqa: E402
from benchmarks.spawn_bench import SpawnConfig  # noqa: E402
from benchmarks.vs_torch import VsTorchConfig  # noqa: E402
from benchmarks.zero_bench import ZeroBenchConfig  # noqa: E402

PARTS = ("vs_torch", "measured_vs_simulated", "overlap", "tooling", "profile", "auto_search", "p2p",
         "grad_compression", "plan_vs_measured", "zero", "spawn", "auto_vs_hand", "moe_overlap")
QUICK_PARTS = PARTS[:4]


@dataclass(frozen=True)
class Plan:
    """Everything one invocation runs."""

    world: int
    """Pipeline ranks (gloo processes)."""
    vs_torch: tuple[VsTorchConfig, ...]
    """Part 1 workloads."""
    sim: SimConfig
    """Part 2."""
    overlap: OverlapConfig
    """Part 3."""
    quick_tooling: bool
    """Run schedule_tooling.py's small grid (part 4)."""
    profile: tuple[tuple[str, str, int], ...] = (("1f1b", "mlp", 60), ("zbv", "transformer", 10))
    """Part 5: (schedule, workload, steps) cases profiled under py-spy on both sides."""
    p2p: P2PConfig = P2PConfig()
    """Part 7: low-precision stage-to-stage sends on the GPT example (benchmarks/p2p_compression.py)."""
    dp_compression: DPBenchConfig = DPBenchConfig()
    """Part 8: gradient compression in training (GPT example, PP=2 x DP=2, 200 steps per method)."""
    plan_vs_measured: PvMConfig = PvMConfig()
    """Part 9: the planner's predictions against runs of 5 candidates (benchmarks/plan_vs_measured.py)."""
    zero: ZeroBenchConfig = ZeroBenchConfig()
    """Part 10: ZeRO memory per rank, ZeRO++ bytes / loss (GPT example, 200 steps per run), ZeRO-2 vs ZeRO-1 speed."""
    spawn: SpawnConfig = SpawnConfig()
    """Part 11: seconds per `run(fn, 4)` of a trivial function, by start method (benchmarks/spawn_bench.py)."""
    auto_vs_hand: AutoBenchConfig = AutoBenchConfig()
    """Part 12: schedule="auto" on the user path against hand-picked schedules (benchmarks/auto_vs_hand.py)."""
    moe: MoEBenchConfig = MoEBenchConfig()
    """Part 13: one MoE F&B pair overlapped vs F then B, and a DualPipeV step, on the emulated link."""


def full_plan() -> Plan:
    """The configuration `make bench` measures (about 10 minutes on 2 shared cores, and part 6 another 5-11)."""
    return Plan(
        world=4,
        vs_torch=(
            VsTorchConfig("overhead-bound", ModelSpec("mlp", num_layers=8, width=256, batch=64), reps=30),
            VsTorchConfig("compute-bound",
                          ModelSpec("transformer", num_layers=8, width=128, batch=32, seq=32), reps=12),
            VsTorchConfig("overhead-bound, fixed shapes", ModelSpec("mlp", num_layers=8, width=256, batch=64),
                          schedules=("1f1b",), reps=30, check_inputs_every_step=False),
        ),
        sim=SimConfig(),
        overlap=OverlapConfig(),
        quick_tooling=False,
    )


def quick_plan() -> Plan:
    """A tiny smoke configuration: 2 ranks, 2 timed steps, milliseconds of sleep."""
    tiny = ModelSpec("mlp", num_layers=4, width=16, batch=8)
    return Plan(
        world=2,
        vs_torch=(VsTorchConfig("overhead-bound", tiny, schedules=("1f1b", "zbv"), num_microbatches=4,
                                warmup=1, reps=2),),
        sim=SimConfig(f_ms=2.0, i_ms=2.0, w_ms=2.0, num_microbatches=4, width=8,
                      schedules=("1f1b", "dualpipe"), warmup=1, reps=2),
        overlap=OverlapConfig(width=1024, num_microbatches=4, compute_ms=1.0, schedules=("1f1b",),
                              warmup=1, reps=2),
        quick_tooling=True,
        p2p=quick_config(),
        plan_vs_measured=pvm_quick_config(),
        spawn=SpawnConfig(reps=1, ranks=2),
        auto_vs_hand=auto_quick_config(),
    )


def _runners(plan: Plan) -> dict[str, Callable[[], Any]]:
    from benchmarks import (
        auto_search,
        auto_vs_hand,
        dp_compression,
        measured_vs_sim,
        moe_overlap,
        overlap,
        p2p_compression,
        plan_vs_measured,
        spawn_bench,
        tooling,
        vs_torch,
        zero_bench,
    )

    return {
        "vs_torch": lambda: [row for cfg in plan.vs_torch for row in vs_torch.run(cfg, plan.world)],
        "measured_vs_simulated": lambda: measured_vs_sim.run(plan.sim, plan.world),
        "overlap": lambda: overlap.run(plan.overlap, plan.world),
        "tooling": lambda: tooling.run(plan.quick_tooling),
        "profile": lambda: _run_profile(plan),
        "auto_search": lambda: auto_search.run(plan.quick_tooling),
        "p2p": lambda: p2p_compression.run(plan.p2p),
        "grad_compression": lambda: dp_compression.run(plan.dp_compression),
        "plan_vs_measured": lambda: plan_vs_measured.run(plan.plan_vs_measured),
        "zero": lambda: zero_bench.run(plan.zero),
        "spawn": lambda: spawn_bench.run(plan.spawn),
        "auto_vs_hand": lambda: auto_vs_hand.run(plan.auto_vs_hand),
        "moe_overlap": lambda: moe_overlap.run(plan.moe),
    }


def _run_profile(plan: Plan) -> dict[str, Any]:
    from benchmarks import profile_runtime

    cases = [{"schedule": schedule, "workload": workload, "steps": steps,
              "ours": profile_runtime.profile("ours", schedule, steps, workload),
              "torch": profile_runtime.profile("torch", schedule, steps, workload)}
             for schedule, workload, steps in plan.profile] if profile_runtime.py_spy() else []
    return {
        "cases": cases,
        "skipped": "" if cases else "py-spy is not installed (.venv/bin/pip install py-spy)",
        "whatif": profile_runtime.whatif("1f1b", 20, "mlp"),
        "whatif_sleep": profile_runtime.whatif("1f1b", 4, "sleep"),
    }


def write_figures(results: dict[str, Any], img_dir: str, link_prefix: str) -> list[tuple[str, str]]:
    """Draw every figure the results allow; return (markdown link, caption) pairs."""
    os.makedirs(img_dir, exist_ok=True)
    made = []
    if any(results.get(k) for k in ("vs_torch", "measured_vs_simulated", "overlap")):
        figures.ratio_bars(results, os.path.join(img_dir, "bench_ratios.png"))
        made.append((f"{link_prefix}bench_ratios.png", "Benchmark ratios against their targets"))
    sim_rows = results.get("measured_vs_simulated") or []
    pick = next((r for r in sim_rows if r["schedule"] == "dualpipe"), sim_rows[0] if sim_rows else None)
    if pick is not None:
        figures.measured_vs_simulated(pick, os.path.join(img_dir, "bench_measured_vs_sim.png"))
        made.append((f"{link_prefix}bench_measured_vs_sim.png",
                     f"Measured vs simulated {pick['schedule']} on the sleep model"))
    if results.get("tooling"):
        figures.tooling_plot(results["tooling"], os.path.join(img_dir, "bench_tooling.png"))
        made.append((f"{link_prefix}bench_tooling.png", "Schedule tooling time against P"))
    return made


def _measure(plan: Plan, chosen: list[str]) -> tuple[dict[str, Any], dict[str, str], dict[str, list[float]],
                                                    dict[str, float]]:
    """Run the chosen parts in order; a failing part is recorded and the others still run."""
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    loads: dict[str, list[float]] = {}
    walls: dict[str, float] = {}
    runners = _runners(plan)
    for part in chosen:
        t0 = time.monotonic()
        loads[part] = [round(x, 2) for x in os.getloadavg()]
        try:
            results[part] = runners[part]()
        except Exception:  # noqa: BLE001 - one broken part must not lose the others' figures
            failures[part] = traceback.format_exc()
            print(f"[{part} FAILED]\n{failures[part]}", file=sys.stderr, flush=True)
        walls[part] = time.monotonic() - t0
        print(f"[{part}: {walls[part]:.0f} s]", file=sys.stderr, flush=True)
    return results, failures, loads, walls


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts, print the tables, write results.json, figures and docs."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (2 ranks, 2 steps)")
    parser.add_argument("--parts", default="",
                        help=f"comma list out of {','.join(PARTS)} (default: all; --quick: no profile)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench-output"), help="results directory")
    parser.add_argument("--docs", default=os.path.join(ROOT, "docs"),
                        help="docs directory to update (benchmarks.md, img/); 'none' to skip")
    parser.add_argument("--load-note", default="", help="how loaded the machine was, for the docs")
    parser.add_argument("--replot", action="store_true",
                        help="measure nothing: redraw figures, tables and docs from OUT/results.json")
    args = parser.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "results.json"), encoding="utf-8") as fh:
            old = json.load(fh)
        _publish(old, args.out, args.docs)
        return 0
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()] or list(
        QUICK_PARTS if args.quick else PARTS)
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    plan = quick_plan() if args.quick else full_plan()
    machine = harness.machine_info()
    started = time.monotonic()
    results, failures, loads, walls = _measure(plan, chosen)
    results["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": _command(list(argv if argv is not None else sys.argv[1:])),
        "wall_s": time.monotonic() - started,
        "machine": machine,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "load_note": args.load_note or "No note on other load was given.",
        "quick": args.quick,
        "world": plan.world,
        "failed_parts": failures,
        "loadavg_at_part_start": loads,
        "part_wall_s": walls,
    }
    report.write_json(results, os.path.join(args.out, "results.json"))
    _publish(results, args.out, args.docs)
    return 1 if failures else 0


def _command(given: list[str]) -> str:
    """The command line as run (the load note itself is recorded on its own)."""
    if "--load-note" in given:
        at = given.index("--load-note")
        given[at:at + 2] = ["--load-note", "NOTE"]
    return "make bench (= .venv/bin/python benchmarks/run_all.py" + "".join(f" {shlex.quote(a)}" for a in given) + ")"


def _publish(results: dict[str, Any], out: str, docs: str) -> None:
    """Print the tables, draw the figures and (unless docs is 'none') rewrite docs/benchmarks.md."""
    print(report.stdout_report(results))
    part = results.get("grad_compression")
    if part:
        from benchmarks import dp_compression

        cfg = plan_config(part)
        print(f"8. Gradient compression in training\n{dp_compression.table(part['rows'], cfg)}")
        if docs != "none":
            part.setdefault("meta", {**results.get("meta", {}), "load_before": results.get("meta", {}).get(
                "loadavg_at_part_start", {}).get("grad_compression", "?")})
            dp_compression.publish(part, docs)
    _publish_zero(results, docs)
    _publish_spawn(results, docs)
    if results.get("moe_overlap"):
        from benchmarks import moe_overlap

        print(f"\n13. MoE F&B overlap\n{moe_overlap.markdown(results['moe_overlap'])}")
        if docs != "none":
            moe_overlap.publish(results["moe_overlap"], docs)
    if docs != "none":
        made = write_figures(results, os.path.join(docs, "img"), "img/")
        report.update_doc(os.path.join(docs, "benchmarks.md"), report.results_markdown(results, made))
    else:
        write_figures(results, out, "")
    if results.get("auto_search"):
        from benchmarks import auto_search

        print(auto_search.text_report(results["auto_search"]))
        if docs != "none":
            auto_search.update_doc(os.path.join(docs, "benchmarks.md"), results["auto_search"])
    if results.get("p2p"):
        _publish_p2p(results, out, docs)
    if results.get("plan_vs_measured"):
        _publish_plan_vs_measured(results, out, docs)
    if results.get("auto_vs_hand"):
        _publish_auto_vs_hand(results, docs)


def _publish_auto_vs_hand(results: dict[str, Any], docs: str) -> None:
    """Part 11 keeps its own block of docs/benchmarks.md."""
    from benchmarks import auto_vs_hand

    meta = results["meta"]
    part = {**results["auto_vs_hand"], "meta": {
        "date": meta["date"], "command": meta["command"], "wall_s": meta["part_wall_s"].get("auto_vs_hand", 0.0),
        "load_before": meta["loadavg_at_part_start"].get("auto_vs_hand"), "load_after": meta["loadavg_after"],
        "load_note": meta["load_note"]}}
    print("\n11. schedule='auto' against hand-picked schedules\n" + auto_vs_hand.text_report(part))
    if docs != "none":
        auto_vs_hand.publish(part, docs)


def _publish_plan_vs_measured(results: dict[str, Any], out: str, docs: str) -> None:
    """Part 9 keeps its own section of docs/benchmarks.md and its figure."""
    from benchmarks import plan_vs_measured

    meta = results["meta"]
    part = {**results["plan_vs_measured"], "meta": {
        "date": meta["date"], "command": meta["command"],
        "wall_s": meta["part_wall_s"].get("plan_vs_measured", 0.0),
        "load_before": meta["loadavg_at_part_start"].get("plan_vs_measured"), "load_after": meta["loadavg_after"],
        "load_note": meta["load_note"]}}
    print("\n9. Planner predictions vs measurement\n" + plan_vs_measured.text_report(part))
    if docs != "none":
        plan_vs_measured.publish(part, docs)
    else:
        plan_vs_measured.figure(part, os.path.join(out, plan_vs_measured.FIGURE))


def _publish_p2p(results: dict[str, Any], out: str, docs: str) -> None:
    """Part 7 keeps its own section of docs/benchmarks.md and its loss figure."""
    from benchmarks import p2p_compression

    meta = results["meta"]
    part = {**results["p2p"], "meta": {
        "date": meta["date"], "command": meta["command"], "wall_s": meta["part_wall_s"].get("p2p", 0.0),
        "load_before": meta["loadavg_at_part_start"].get("p2p"), "load_after": meta["loadavg_after"],
        "load_note": meta["load_note"]}}
    print("\n7. Low-precision stage-to-stage sends\n" + report.text_table(p2p_compression.table(part)))
    if docs != "none":
        p2p_compression.publish(part, docs)
    else:
        p2p_compression.loss_figure(part, os.path.join(out, "p2p_loss.png"))


def _publish_zero(results: dict[str, Any], docs: str) -> None:
    """Print part 10 and (unless docs is 'none') write its section of docs/benchmarks.md."""
    part = results.get("zero")
    if not part:
        return
    from benchmarks import zero_bench

    meta = results.get("meta", {})
    part.setdefault("meta", {**meta, "load_before": meta.get("loadavg_at_part_start", {}).get("zero", "?")})
    print(f"\n10. ZeRO\n{zero_bench.markdown(part)}")
    if docs != "none":
        zero_bench.publish(part, docs)


def _publish_spawn(results: dict[str, Any], docs: str) -> None:
    """Print part 11 and (unless docs is 'none') write its section of docs/benchmarks.md."""
    part = results.get("spawn")
    if not part:
        return
    from benchmarks import spawn_bench

    part.setdefault("meta", results.get("meta", {}))
    print(f"\n11. Starting processes\n{spawn_bench.markdown(part)}")
    if docs != "none":
        spawn_bench.publish(part, docs)


def plan_config(part: dict[str, Any]) -> DPBenchConfig:
    """The DPBenchConfig a grad_compression result was measured with."""
    return DPBenchConfig(**{**part["config"], "methods": tuple(part["config"]["methods"])})


if __name__ == "__main__":
    sys.exit(main())
