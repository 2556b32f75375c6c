"""The `duplexpipe` command: list, show, verify, simulate, compare, export, plot and train schedules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn, Sequence

from duplexpipe import cli_help as docs
from duplexpipe import cli_plan
from duplexpipe.cli_args import (
    COSTS_PER,
    MAX_PLOT_RANKS,
    CliError,
    check_output,
    cost_model,
    load_schedule,
    load_timeline,
    parse_opts,
    parse_ranks,
    parse_window,
    positive,
    require_matplotlib,
    with_cost,
)
from duplexpipe.schedules.ir import Schedule, ScheduleError, save_json, save_torch_csv

__all__ = ["CliError", "compare_rows", "compare_schedules", "load_schedule", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")


def _command(sub: Any, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand with its description, examples and exit codes from `cli_help`."""
    return sub.add_parser(name, help=summary, description=docs.DESCRIPTIONS[name], epilog=docs.EPILOGS[name],
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_schedule(p: argparse.ArgumentParser, many: bool = False) -> None:
    if many:
        p.add_argument("schedules", nargs="*", metavar="NAME|FILE", help=docs.SCHEDULES_ARG)
    else:
        p.add_argument("schedule", metavar="NAME|FILE", help=docs.SCHEDULE_ARG)
    p.add_argument("-p", "--ranks", type=positive("ranks"), help="pipeline ranks P (built-in schedules)")
    p.add_argument("-m", "--microbatches", type=positive("microbatches"),
                   help="microbatches M per step (built-in schedules)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a generator option, repeatable, e.g. --opt chunks=4 for interleaved-1f1b (values: "
                        "int, float, true/false or text; 'duplexpipe schedules' lists each one's options)")


def _add_cost(p: argparse.ArgumentParser, planning_only: bool = False) -> None:
    group = p.add_argument_group("costs" + (" (only for generators that plan by cost)" if planning_only else ""),
                                 None if planning_only else docs.COSTS)
    group.add_argument("--cost", default="", metavar="SPEC",
                       help="F=1,B=2,W=1 (defaults), FB=3 (an F&B pair; default F+B), latency=0, bandwidth=1e9 "
                            "(bytes per unit time), bytes=4e6 (one message)")
    group.add_argument("--stage-cost", action="append", default=[], metavar="STAGES:SPEC",
                       help="F/B/W of some stages, repeatable: 3:F=1.5,B=3 or 0-3:F=2 (unset keys keep --cost's)")
    group.add_argument("--costs-per", choices=COSTS_PER, default=None,
                       help="model-part (default): costs are the times of 1/P of the model; stage: of one stage")


def _add_view(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ranks-shown", type=parse_ranks, metavar="RANKS",
                   help=f"draw only these ranks{what}, e.g. 0-7,60-63")
    p.add_argument("--window", type=parse_window, metavar="START:END",
                   help=f"draw only this stretch of the time axis{what}, in its units (e.g. 0:300, 1200:)")


def _build_parser(with_train: bool = False) -> _Parser:
    parser = _Parser(prog="duplexpipe", description=docs.DESCRIPTIONS["duplexpipe"], epilog=docs.EPILOGS["duplexpipe"],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _command(sub, "schedules", "list the built-in schedules, their constraints and options")
    show = _command(sub, "show", "print a schedule's rank x step grid")
    _add_schedule(show)
    show.add_argument("--comms", action="store_true", help="show the lowered schedule with SEND/RECV")
    _add_cost(show, planning_only=True)
    ver = _command(sub, "verify", "check completeness, ordering and deadlock freedom (exit 1 if unsound)")
    _add_schedule(ver)
    ver.add_argument("--nccl", action="store_true", help="also check that every two ranks post the messages "
                     "between them in one order (NCCL runs both directions on one stream)")
    _add_cost(ver, planning_only=True)
    sim = _command(sub, "simulate", "time a schedule under a cost model")
    _add_schedule(sim)
    _add_cost(sim)
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--plot", metavar="FILE", help="write a Gantt chart (.png, .svg or .pdf; needs matplotlib)")
    sim.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (.json)")
    _add_view(sim, " in --plot")
    cli_plan.add_profile_option(sim)
    cmp_ = _command(sub, "compare", "simulate several schedules on one model and tabulate them")
    _add_schedule(cmp_, many=True)
    _add_cost(cmp_)
    cmp_.add_argument("--json", action="store_true", help="print the table as JSON")
    cmp_.add_argument("--plot", metavar="FILE", help="write the comparison figure (.png, .svg or .pdf)")
    cli_plan.add_profile_option(cmp_)
    exp = _command(sub, "export", "write a schedule as JSON or torch CSV")
    _add_schedule(exp)
    exp.add_argument("--format", choices=("json", "torch-csv"), required=True,
                     help="json: duplexpipe's, with the stage table; torch-csv: one row of actions per rank, "
                          "as torch.distributed.pipelining's _dump_csv writes and _load_csv reads")
    exp.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")
    exp.add_argument("--comms", action="store_true", help="export the lowered schedule (with SEND/RECV)")
    _add_cost(exp, planning_only=True)
    plot = _command(sub, "plot", "draw a timeline file (e.g. timeline.json from 'duplexpipe train --out-dir')")
    plot.add_argument("timeline", metavar="TIMELINE.json", help="a timeline JSON file (Timeline.to_dict())")
    plot.add_argument("-o", "--output", metavar="FILE",
                      help="the figure (.png, .svg or .pdf; default: TIMELINE with .png)")
    plot.add_argument("--no-activations", action="store_true", help="leave out the live-activations panel")
    _add_view(plot, "")
    _add_train_parser(sub, with_train)
    cli_plan.add_parsers(sub)
    return parser


def _add_train_parser(sub: Any, full: bool) -> None:
    train = sub.add_parser("train", help="train a model (default: the bundled GPT example) on local CPU "
                           "processes, or under torchrun")
    if full:  # its options come from the training module, which imports torch: only when needed
        from duplexpipe.pipeline.train import add_train_arguments

        add_train_arguments(train)


def _schedule_of(args: argparse.Namespace) -> Schedule:
    """The schedule a show/verify/simulate/export command names, with its options and cost model."""
    return load_schedule(args.schedule, args.ranks, args.microbatches, parse_opts(args.opt), _cost_of(args))


def _cost_of(args: argparse.Namespace) -> Any:
    return cost_model(args.cost, args.stage_cost, args.costs_per)


def _cmd_schedules(_: argparse.Namespace) -> int:
    from duplexpipe.schedules import registry

    width = max(len(n) for n in registry.names())
    for name in registry.names():
        options = registry.entry(name).options
        extra = f" [options: {', '.join(options)}]" if options else ""
        print(f"{name:<{width}}  {registry.describe(name)}{extra}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.lower import lower
    from duplexpipe.viz.text import render_text

    schedule = _schedule_of(args)
    if args.comms and not schedule.has_comms:
        schedule = lower(schedule)
    print(render_text(schedule))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.verify import verify

    schedule = _schedule_of(args)
    try:
        verify(schedule, nccl=args.nccl)
    except ScheduleError as exc:
        print(f"UNSOUND {schedule.name}: {exc}")
        return 1
    print(f"OK {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_microbatches} microbatches, "
          f"{schedule.num_stages} stages: complete, ordered, deadlock-free{', NCCL pair order' if args.nccl else ''}")
    return 0


def cost_note(cost: Any, schedule: Schedule | None = None) -> str:
    """The cost convention in words: `costs per 1/P of the model: F=1 B=2 W=1 (...)`."""
    values = f"F={cost.f:g} B={cost.b:g} W={cost.w:g}" + ("" if cost.fb is None else f" FB={cost.fb:g}")
    if cost.stage_costs:
        values += f", {len(cost.stage_costs)} stage(s) overridden"
    if cost.comm_time:
        values += f", message time {cost.comm_time:g}"
    if not cost.stage_scale:
        return f"costs per stage: {values}"
    note = f"costs per 1/P of the model: {values}"
    if schedule is not None and schedule.num_groups != schedule.num_ranks:
        factor = schedule.num_ranks / schedule.num_groups
        note += (f" (the model is cut into {schedule.num_groups} parts on {schedule.num_ranks} ranks: each stage "
                 f"takes {factor:g}x; --costs-per stage for per-stage costs)")
    return note


def _check_view_args(args: argparse.Namespace, schedule: Schedule | None, drawing: bool) -> None:
    if not drawing and (args.ranks_shown is not None or args.window is not None):
        raise CliError("--ranks-shown and --window shape the plot: they need --plot")
    ranks = schedule.num_ranks if schedule is not None else args.ranks or 0
    if drawing and args.ranks_shown is None and ranks > MAX_PLOT_RANKS:
        raise CliError(f"--plot draws at most {MAX_PLOT_RANKS:,} ranks, the schedule has {ranks:,}: pick some "
                       "with --ranks-shown")
    if ranks and args.ranks_shown and max(args.ranks_shown) >= ranks:
        raise CliError(f"--ranks-shown names rank {max(args.ranks_shown)}, but the schedule has ranks 0..{ranks - 1}")


def _cmd_simulate(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.simulate import simulate, summary

    _check_view_args(args, None, bool(args.plot))
    for path, option, figure in ((args.plot, "--plot", True), (args.trace, "--trace", False)):
        if path:
            check_output(path, option, figure=figure)
    cost = _cost_of(args)
    schedule = load_schedule(args.schedule, args.ranks, args.microbatches, parse_opts(args.opt), cost)
    _check_view_args(args, schedule, bool(args.plot))
    timeline = simulate(schedule, cost)
    result = {"schedule": schedule.name, "ranks": schedule.num_ranks, "microbatches": schedule.num_microbatches,
              "costs_per": COSTS_PER[0] if cost.stage_scale else COSTS_PER[1], "cost": cost.to_dict(),
              **summary(timeline)}
    if args.plot:
        _viz("plot_timeline")(timeline, args.plot, activations=True, ranks=args.ranks_shown, window=args.window)
    if args.trace:
        from duplexpipe.viz.trace import to_chrome_trace  # no matplotlib needed

        to_chrome_trace(timeline, args.trace)
    if args.profile:
        result["memory"] = cli_plan.profile_memory(schedule, timeline, args.profile)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{schedule.name}: P={schedule.num_ranks} M={schedule.num_microbatches} "
          f"makespan={result['makespan']:g} bubble_ratio={result['bubble_ratio']:.3f}")
    print(cost_note(cost, schedule))
    print(f"{'rank':>4} {'busy':>10} {'idle':>10} {'peak_act':>8}")
    for row in result["per_rank"]:
        print(f"{row['rank']:>4} {row['busy']:>10g} {row['idle']:>10g} {row['peak_activations']:>8}")
    if args.profile:
        print("\n".join(["memory per rank (bytes, at the profile's microbatch):",
                         *cli_plan.memory_lines(result["memory"])]))
    for label, path in (("plot", args.plot), ("trace", args.trace)):
        if path:
            print(f"{label} written to {path}")
    return 0


def _viz(name: str) -> Any:
    """A drawing function of duplexpipe.viz, or CliError with the install hint if matplotlib is missing."""
    require_matplotlib(f"drawing ({name})")
    import duplexpipe.viz as viz

    return getattr(viz, name)


def compare_schedules(entries: Sequence[tuple[str, Schedule | str]], cost: Any) -> tuple[list[dict[str, Any]],
                                                                                        list[Any]]:
    """Simulate each (label, schedule) under `cost` as given; a (label, reason) entry becomes a skipped row.
    Returns the table rows and the timelines."""
    from duplexpipe.schedules import registry
    from duplexpipe.schedules.simulate import simulate

    rows: list[dict[str, Any]] = []
    timelines: list[Any] = []
    for label, schedule in entries:
        if isinstance(schedule, str):
            rows.append({"schedule": label, "skipped": schedule})
            continue
        timeline = simulate(schedule, cost)
        timelines.append(timeline)
        peak = max(timeline.peak_activations(r) for r in range(schedule.num_ranks))
        rows.append({
            "schedule": label, "ranks": schedule.num_ranks, "microbatches": schedule.num_microbatches,
            "makespan": timeline.makespan, "bubble_ratio": timeline.bubble_ratio, "peak_activations": peak,
            "peak_activation_memory": peak * schedule.num_ranks / schedule.num_groups,
            "params_per_rank": registry.params_per_rank(schedule),
        })
    return rows, timelines


def compare_rows(ranks: int, microbatches: int, cost: Any, names: Sequence[str] | None = None,
                 options: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Simulate built-in schedules for P and M under `cost` as given (its stage_scale included): `names`,
    or every schedule (one that rejects P and M becomes a skipped row). Returns rows and timelines."""
    entries = _builtin_entries(list(names or []), ranks, microbatches, options or {}, cost)
    return compare_schedules(entries, cost)


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
    cost = _cost_of(args)
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
        cli_plan.add_peak_bytes(rows, timelines, args.profile)
    if args.plot:
        if not timelines:
            raise CliError("no schedule could be simulated: nothing to plot")
        _viz("plot_comparison")(timelines, args.plot)
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
              + (f"  peak {cli_plan.format_bytes(row['peak_bytes'])}/rank" if "peak_bytes" in row else ""))


def _cmd_export(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.lower import lower

    check_output(args.output, "-o")
    schedule = _schedule_of(args)
    if args.format == "torch-csv" and schedule.num_copies > 1:
        raise CliError(f"{schedule.name} runs {schedule.num_copies} model copies; a torch CSV has no stage table "
                       "to say so (a reader would see one chain of stages and find actions missing): use "
                       "--format json")
    if args.comms:
        schedule = lower(schedule)
    (save_json if args.format == "json" else save_torch_csv)(schedule, args.output)
    print(f"wrote {schedule.name} ({args.format}) to {args.output}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    output = args.output or os.path.splitext(args.timeline)[0] + ".png"
    check_output(output, "-o" if args.output else "the figure", figure=True)
    timeline = load_timeline(args.timeline)
    if args.ranks_shown and max(args.ranks_shown) >= timeline.num_ranks:
        raise CliError(f"--ranks-shown names rank {max(args.ranks_shown)}, but {args.timeline} has ranks "
                       f"0..{timeline.num_ranks - 1}")
    _viz("plot_timeline")(timeline, output, activations=not args.no_activations, ranks=args.ranks_shown,
                          window=args.window)
    print(f"{timeline.source} {timeline.schedule_name}: {timeline.num_ranks} ranks, {timeline.num_microbatches} "
          f"microbatches, makespan {timeline.makespan:.4g} {timeline.unit}, bubble ratio {timeline.bubble_ratio:.1%}")
    print(f"plot written to {output}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from duplexpipe.pipeline.launch import LaunchError
    from duplexpipe.pipeline.train import train_main

    try:
        return train_main(args)
    except LaunchError as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        print(f"duplexpipe: error: rank {exc.rank} failed: {last}", file=sys.stderr)
        return 1


_COMMANDS = {
    "schedules": _cmd_schedules, "show": _cmd_show, "verify": _cmd_verify, "simulate": _cmd_simulate,
    "compare": _cmd_compare, "export": _cmd_export, "plot": _cmd_plot, "train": _cmd_train,
    "plan": cli_plan.cmd_plan, "profile": cli_plan.cmd_profile,
}


def _fail(message: str) -> int:
    print(f"duplexpipe: error: {message}".splitlines()[0], file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `duplexpipe` console script; returns the exit code."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = _build_parser(with_train="train" in argv).parse_args(argv)
        return _COMMANDS[args.command](args)
    except (CliError, ScheduleError, ValueError) as exc:
        return _fail(str(exc))
    except BrokenPipeError:  # e.g. `duplexpipe show ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a file that vanished or became unwritable after the checks, a full disk, ...
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}")
    except MemoryError:
        return _fail("out of memory; use fewer ranks or microbatches")
    except KeyboardInterrupt:
        print("duplexpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
