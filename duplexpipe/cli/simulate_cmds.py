"""The `simulate`, `compare` and `plot` commands: time schedules under a cost model and draw timelines."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from duplexpipe.cli import plan_cmds
from duplexpipe.cli.args import (
    COSTS_PER,
    CliError,
    add_cost,
    add_schedule,
    add_view,
    add_zero3,
    check_output,
    check_view_args,
    command,
    cost_of,
    load_schedule,
    load_timeline,
    parse_opts,
    viz,
    with_zero3,
)
from duplexpipe.planner.memory import add_peak_bytes, profile_memory
from duplexpipe.schedules.compare import compare_schedules, cost_note, with_cost
from duplexpipe.schedules.ir import Schedule
from duplexpipe.sizes import format_bytes


def add_parsers(sub: Any) -> None:
    """Add `simulate`, `compare` and `plot` to the `duplexpipe` subcommands."""
    sim = command(sub, "simulate", "time a schedule under a cost model")
    add_schedule(sim)
    add_zero3(sim)
    add_cost(sim)
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--plot", metavar="FILE", help="write a Gantt chart (.png, .svg or .pdf; needs matplotlib)")
    sim.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (.json)")
    add_view(sim, " in --plot")
    plan_cmds.add_profile_option(sim)
    cmp_ = command(sub, "compare", "simulate several schedules on one model and tabulate them")
    add_schedule(cmp_, many=True)
    add_cost(cmp_)
    cmp_.add_argument("--json", action="store_true", help="print the table as JSON")
    cmp_.add_argument("--plot", metavar="FILE", help="write the comparison figure (.png, .svg or .pdf)")
    plan_cmds.add_profile_option(cmp_)
    plot = command(sub, "plot", "draw a timeline file (e.g. timeline.json from 'duplexpipe train --out-dir')")
    plot.add_argument("timeline", metavar="TIMELINE.json", help="a timeline JSON file (Timeline.to_dict())")
    plot.add_argument("-o", "--output", metavar="FILE",
                      help="the figure (.png, .svg or .pdf; default: TIMELINE with .png)")
    plot.add_argument("--no-activations", action="store_true", help="leave out the live-activations panel")
    add_view(plot, "")


def _cmd_simulate(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.simulate import simulate, summary

    check_view_args(args, None, bool(args.plot))
    for path, option, figure in ((args.plot, "--plot", True), (args.trace, "--trace", False)):
        if path:
            check_output(path, option, figure=figure)
    cost = cost_of(args)
    schedule = with_zero3(load_schedule(args.schedule, args.ranks, args.microbatches, parse_opts(args.opt), cost),
                          args)
    check_view_args(args, schedule, bool(args.plot))
    timeline = simulate(schedule, cost)
    result = {"schedule": schedule.name, "ranks": schedule.num_ranks, "microbatches": schedule.num_microbatches,
              "costs_per": COSTS_PER[0] if cost.stage_scale else COSTS_PER[1], "cost": cost.to_dict(),
              **summary(timeline)}
    if args.plot:
        _draw(timeline, args.plot, args, activations=True)
    if args.trace:
        from duplexpipe.viz.trace import to_chrome_trace  # no matplotlib needed

        to_chrome_trace(timeline, args.trace)
    if args.profile:
        result["memory"] = profile_memory(schedule, timeline, args.profile)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{schedule.name}: P={schedule.num_ranks} M={schedule.num_microbatches} "
          f"makespan={result['makespan']:g} bubble_ratio={result['bubble_ratio']:.3f}")
    print(cost_note(cost, schedule))
    if "step_time" in result:
        print(f"ZeRO-3: step_time={result['step_time']:g} (from the first all-gather to the last reduce-scatter)")
    zero3 = "all_gathers" in result["per_rank"][0]
    memory = "peak_param_bytes" in result["per_rank"][0]
    print(f"{'rank':>4} {'busy':>10} {'idle':>10} {'peak_act':>8}" + (f" {'gathers':>7}" if zero3 else "")
          + (f" {'peak_params':>11} {'peak_grads':>10}" if memory else ""))
    for row in result["per_rank"]:
        print(f"{row['rank']:>4} {row['busy']:>10g} {row['idle']:>10g} {row['peak_activations']:>8}"
              + (f" {row['all_gathers']:>7}" if zero3 else "")
              + (f" {format_bytes(row['peak_param_bytes']):>11} {format_bytes(row['peak_grad_bytes']):>10}"
                 if memory else ""))
    if args.profile:
        print("\n".join(["memory per rank (bytes, at the profile's microbatch):",
                         *plan_cmds.memory_lines(result["memory"])]))
    for label, path in (("plot", args.plot), ("trace", args.trace)):
        if path:
            print(f"{label} written to {path}")
    return 0


def _builtin_entries(names: list[str], ranks: int | None, microbatches: int | None, options: dict[str, Any],
                     cost: Any) -> list[tuple[str, Schedule | str]]:
    """(name, schedule) for `names` (an error if one rejects P and M), or for every built-in schedule when
    `names` is empty ((name, reason) for one that rejects them). Options go where the entry takes them."""
    from duplexpipe.schedules import registry

    every = not names
    names = names or list(registry.names())
    unused = sorted(set(options) - {o for n in names for o in registry.entry(n).options})
    if unused:
        raise CliError(f"--opt {', '.join(unused)}: taken by none of the compared schedules ("
                       + "; ".join(f"{n}: {', '.join(registry.entry(n).options) or 'no options'}" for n in names)
                       + ")")
    entries: list[tuple[str, Schedule | str]] = []
    for name in names:
        own = {k: v for k, v in options.items() if k in registry.entry(name).options}
        if every and ranks is not None and microbatches is not None:
            reason = registry.check(name, ranks, microbatches, **with_cost(name, own, cost))
            if reason is not None:
                entries.append((name, reason))
                continue
        entries.append((name, load_schedule(name, ranks, microbatches, own, cost)))
    return entries


def _cmd_compare(args: argparse.Namespace) -> int:
    from duplexpipe.schedules import registry

    if args.plot:
        check_output(args.plot, "--plot", figure=True)
    cost = cost_of(args)
    options = parse_opts(args.opt)
    builtin = [s for s in args.schedules if s in registry.names()]
    files = [s for s in args.schedules if s not in registry.names()]
    if files and options and not builtin:
        raise CliError("--opt applies to built-in schedules; only files are compared")
    entries = _builtin_entries(builtin, args.ranks, args.microbatches, options, cost) if builtin or not files else []
    entries += [(f, load_schedule(f, None, None)) for f in files]
    order = {spec: i for i, spec in enumerate(args.schedules)}
    entries.sort(key=lambda e: order.get(e[0], 0))
    rows, timelines = compare_schedules(entries, cost)
    if args.profile:
        add_peak_bytes(rows, timelines, args.profile)
    if args.plot:
        if not timelines:
            raise CliError("no schedule could be simulated: nothing to plot")
        viz("plot_comparison")(timelines, args.plot)
    if args.json:
        print(json.dumps({"ranks": args.ranks, "microbatches": args.microbatches,
                          "costs_per": COSTS_PER[0] if cost.stage_scale else COSTS_PER[1], "cost": cost.to_dict(),
                          "schedules": rows}, indent=2))
        return 0
    _print_table(rows, cost)
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


def _print_table(rows: list[dict[str, Any]], cost: Any) -> None:
    shapes = {(r["ranks"], r["microbatches"]) for r in rows if "skipped" not in r}
    shape = f"P={next(iter(shapes))[0]} M={next(iter(shapes))[1]}; " if len(shapes) == 1 else ""
    print(f"{shape}{cost_note(cost)}; peak_act in stage-microbatches, act_mem in 1F1B-stage activations")
    width = max([17] + [len(r["schedule"]) + 1 for r in rows])
    size = "" if len(shapes) <= 1 else f" {'P':>5} {'M':>6}"
    print(f"{'schedule':<{width}}{size} {'makespan':>9} {'bubble':>7} {'peak_act':>8} {'act_mem':>7} {'params':>7}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['schedule']:<{width}} skipped: {row['skipped']}")
            continue
        dims = "" if len(shapes) <= 1 else f" {row['ranks']:>5} {row['microbatches']:>6}"
        print(f"{row['schedule']:<{width}}{dims} {row['makespan']:>9.2f} {row['bubble_ratio']:>7.1%} "
              f"{row['peak_activations']:>8} {row['peak_activation_memory']:>7.1f} {row['params_per_rank']:>6.1f}x"
              + (f"  peak {format_bytes(row['peak_bytes'])}/rank" if "peak_bytes" in row else ""))


def _draw(timeline: Any, path: str, args: argparse.Namespace, activations: bool) -> None:
    """The Gantt chart; with the timeline's extra lanes (MoE exchanges "ep", data-parallel reductions "dp")
    below it when it has some and the whole run is drawn."""
    if timeline.spans and args.ranks_shown is None and args.window is None:
        viz("plot_timeline_lanes")(timeline, path)
    else:
        viz("plot_timeline")(timeline, path, activations=activations, ranks=args.ranks_shown, window=args.window)


def _cmd_plot(args: argparse.Namespace) -> int:
    output = args.output or os.path.splitext(args.timeline)[0] + ".png"
    check_output(output, "-o" if args.output else "the figure", figure=True)
    timeline = load_timeline(args.timeline)
    if args.ranks_shown and max(args.ranks_shown) >= timeline.num_ranks:
        raise CliError(f"--ranks-shown names rank {max(args.ranks_shown)}, but {args.timeline} has ranks "
                       f"0..{timeline.num_ranks - 1}")
    _draw(timeline, output, args, activations=not args.no_activations)
    print(f"{timeline.source} {timeline.schedule_name}: {timeline.num_ranks} ranks, {timeline.num_microbatches} "
          f"microbatches, makespan {timeline.makespan:.4g} {timeline.unit}, bubble ratio {timeline.bubble_ratio:.1%}")
    print(f"plot written to {output}")
    return 0


COMMANDS = {"simulate": _cmd_simulate, "compare": _cmd_compare, "plot": _cmd_plot}
