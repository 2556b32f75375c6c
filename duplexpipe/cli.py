"""The `duplexpipe` command: list, show, verify, simulate, compare, export and train schedules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn, Sequence

from duplexpipe import cli_plan
from duplexpipe.schedules.ir import Schedule, ScheduleError, load_json, load_torch_csv, save_json, save_torch_csv

_SCHEDULE_HELP = ("a built-in schedule (see 'duplexpipe schedules'; needs -p and -m) or a schedule file: "
                  ".json (duplexpipe) or .csv (torch.distributed.pipelining's _dump_csv)")
_EPILOG = """examples:
  duplexpipe schedules
  duplexpipe show dualpipe -p 4 -m 8
  duplexpipe verify dualpipe -p 8 -m 32 --nccl
  duplexpipe simulate zb-h1 -p 8 -m 32 --cost F=1,B=2,W=1,latency=0.1 --plot zb.png --trace zb.json
  duplexpipe compare -p 4 -m 8 --plot compare.png
  duplexpipe export dualpipev -p 4 -m 8 --format torch-csv -o dualpipev.csv
  duplexpipe train --schedule dualpipe --ranks 4 --steps 50 --out-dir run/

exit codes: 0 ok, 1 unsound schedule (verify) or a failed training rank, 2 bad input"""


class CliError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")


def _positive(kind: str):  # type: ignore[no-untyped-def]
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{kind} must be >= 1, got {value}")
        return value

    return convert


def _add_shape(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("-p", "--ranks", type=_positive("ranks"), required=required, help="pipeline ranks P")
    p.add_argument("-m", "--microbatches", type=_positive("microbatches"), required=required,
                   help="microbatches M per step")


def _add_cost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", default="", metavar="SPEC",
                   help="cost model, e.g. F=1,B=2,W=1,FB=3,latency=0,bandwidth=1e9,bytes=4e6 (defaults F=1,B=2,W=1)")


def _build_parser(with_train: bool = False) -> _Parser:
    parser = _Parser(prog="duplexpipe", description="Pipeline schedules as data: generate, verify, "
                     "simulate, compare, draw, export and train.", epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    sub.add_parser("schedules", help="list the built-in schedules, one line each")
    show = sub.add_parser("show", help="print a schedule's rank x step grid")
    show.add_argument("schedule", metavar="NAME|FILE", help=_SCHEDULE_HELP)
    _add_shape(show, required=False)
    show.add_argument("--comms", action="store_true", help="show the lowered schedule with SEND/RECV")
    ver = sub.add_parser("verify", help="check completeness, ordering and deadlock freedom (exit 1 if unsound)")
    ver.add_argument("schedule", metavar="NAME|FILE", help=_SCHEDULE_HELP)
    _add_shape(ver, required=False)
    ver.add_argument("--nccl", action="store_true", help="also check that every two ranks post the messages "
                     "between them in one order (NCCL runs both directions on one stream)")
    sim = sub.add_parser("simulate", help="time a schedule under a cost model")
    sim.add_argument("schedule", metavar="NAME|FILE", help=_SCHEDULE_HELP)
    _add_shape(sim, required=False)
    _add_cost(sim)
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--plot", metavar="FILE", help="write a Gantt chart (.png, .svg or .pdf)")
    sim.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (.json)")
    cli_plan.add_profile_option(sim)
    cmp_ = sub.add_parser("compare", help="compare every schedule that accepts P and M")
    _add_shape(cmp_)
    _add_cost(cmp_)
    cmp_.add_argument("--json", action="store_true", help="print the table as JSON")
    cmp_.add_argument("--plot", metavar="FILE", help="write the comparison figure (.png, .svg or .pdf)")
    cli_plan.add_profile_option(cmp_)
    exp = sub.add_parser("export", help="write a schedule as JSON or torch CSV")
    exp.add_argument("schedule", metavar="NAME|FILE", help=_SCHEDULE_HELP)
    _add_shape(exp, required=False)
    exp.add_argument("--format", choices=("json", "torch-csv"), required=True)
    exp.add_argument("-o", "--output", required=True, metavar="FILE")
    exp.add_argument("--comms", action="store_true", help="export the lowered schedule (with SEND/RECV)")
    _add_train_parser(sub, with_train)
    cli_plan.add_parsers(sub)
    return parser


def _add_train_parser(sub: Any, full: bool) -> None:
    train = sub.add_parser("train", help="train a model (default: the bundled GPT example) on local CPU "
                           "processes, or under torchrun")
    if full:  # its options come from the training module, which imports torch: only when needed
        from duplexpipe.pipeline.train import add_train_arguments

        add_train_arguments(train)


def load_schedule(spec: str, ranks: int | None, microbatches: int | None) -> Schedule:
    """A built-in schedule by name (needs P and M), or a JSON / torch CSV file."""
    from duplexpipe.schedules import registry

    if spec in registry.names():
        if ranks is None or microbatches is None:
            raise CliError(f"schedule {spec!r} needs --ranks and --microbatches")
        try:
            return registry.build(spec, ranks, microbatches)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if os.path.exists(spec) or spec.endswith((".json", ".csv")):
        if spec.endswith(".csv"):
            return load_torch_csv(spec, num_microbatches=microbatches)
        return load_json(spec)
    raise CliError(f"unknown schedule {spec!r}: expected one of {', '.join(registry.names())} or a .json/.csv file")


def _cost(text: str) -> Any:
    from duplexpipe.schedules.simulate import CostModel

    try:
        return CostModel.parse(text) if text else CostModel()
    except ValueError as exc:
        raise CliError(f"bad --cost: {exc}") from None


def _cmd_schedules(_: argparse.Namespace) -> int:
    from duplexpipe.schedules import registry

    width = max(len(n) for n in registry.names())
    for name in registry.names():
        print(f"{name:<{width}}  {registry.describe(name)}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.lower import lower
    from duplexpipe.viz import render_text

    schedule = load_schedule(args.schedule, args.ranks, args.microbatches)
    if args.comms and not schedule.has_comms:
        schedule = lower(schedule)
    print(render_text(schedule))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.verify import verify

    schedule = load_schedule(args.schedule, args.ranks, args.microbatches)
    try:
        verify(schedule, nccl=args.nccl)
    except ScheduleError as exc:
        print(f"UNSOUND {schedule.name}: {exc}")
        return 1
    print(f"OK {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_microbatches} microbatches, "
          f"{schedule.num_stages} stages: complete, ordered, deadlock-free{', NCCL pair order' if args.nccl else ''}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.simulate import simulate, summary

    schedule = load_schedule(args.schedule, args.ranks, args.microbatches)
    timeline = simulate(schedule, _cost(args.cost))
    result = {"schedule": schedule.name, "ranks": schedule.num_ranks,
              "microbatches": schedule.num_microbatches, **summary(timeline)}
    if args.plot:
        from duplexpipe.viz import plot_timeline

        plot_timeline(timeline, args.plot, activations=True)
    if args.trace:
        from duplexpipe.viz import to_chrome_trace

        to_chrome_trace(timeline, args.trace)
    if args.profile:
        result["memory"] = cli_plan.profile_memory(schedule, timeline, args.profile)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{schedule.name}: P={schedule.num_ranks} M={schedule.num_microbatches} "
          f"makespan={result['makespan']:g} bubble_ratio={result['bubble_ratio']:.3f}")
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


def compare_rows(ranks: int, microbatches: int, cost: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """Simulate every schedule that accepts P and M; return table rows and timelines."""
    from dataclasses import replace

    from duplexpipe.schedules import registry
    from duplexpipe.schedules.simulate import simulate

    rows: list[dict[str, Any]] = []
    timelines: list[Any] = []
    for name in registry.names():
        reason = registry.check(name, ranks, microbatches)
        if reason is not None:
            rows.append({"schedule": name, "skipped": reason})
            continue
        schedule = registry.build(name, ranks, microbatches)
        timeline = simulate(schedule, replace(cost, stage_scale=True))
        timelines.append(timeline)
        peak = max(timeline.peak_activations(r) for r in range(ranks))
        rows.append({
            "schedule": name, "makespan": timeline.makespan, "bubble_ratio": timeline.bubble_ratio,
            "peak_activations": peak,
            "peak_activation_memory": peak * ranks / schedule.num_groups,
            "params_per_rank": registry.params_per_rank(schedule),
        })
    return rows, timelines


def _cmd_compare(args: argparse.Namespace) -> int:
    rows, timelines = compare_rows(args.ranks, args.microbatches, _cost(args.cost))
    if args.profile:
        cli_plan.add_peak_bytes(rows, timelines, args.profile)
    if args.plot:
        from duplexpipe.viz import plot_comparison

        plot_comparison(timelines, args.plot)
    if args.json:
        print(json.dumps({"ranks": args.ranks, "microbatches": args.microbatches, "schedules": rows}, indent=2))
        return 0
    print(f"P={args.ranks} M={args.microbatches}; costs per 1/P of the model; peak_act in stage-microbatches, "
          "act_mem in 1F1B-stage activations")
    print(f"{'schedule':<17} {'makespan':>9} {'bubble':>7} {'peak_act':>8} {'act_mem':>7} {'params':>7}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['schedule']:<17} skipped: {row['skipped']}")
            continue
        print(f"{row['schedule']:<17} {row['makespan']:>9.2f} {row['bubble_ratio']:>7.1%} "
              f"{row['peak_activations']:>8} {row['peak_activation_memory']:>7.1f} {row['params_per_rank']:>6.1f}x"
              + (f"  peak {cli_plan.format_bytes(row['peak_bytes'])}/rank" if "peak_bytes" in row else ""))
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.lower import lower

    schedule = load_schedule(args.schedule, args.ranks, args.microbatches)
    if args.comms:
        schedule = lower(schedule)
    try:
        (save_json if args.format == "json" else save_torch_csv)(schedule, args.output)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror}") from None
    print(f"wrote {schedule.name} ({args.format}) to {args.output}")
    if args.format == "torch-csv" and schedule.num_copies > 1:
        print(f"note: torch's CSV holds no stage table; this schedule runs {schedule.num_copies} model copies, "
              "which a CSV reader sees as one chain of stages. Use --format json to keep the table.")
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
    "compare": _cmd_compare, "export": _cmd_export, "train": _cmd_train,
    "plan": cli_plan.cmd_plan, "profile": cli_plan.cmd_profile,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `duplexpipe` console script; returns the exit code."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = _build_parser(with_train="train" in argv).parse_args(argv)
        return _COMMANDS[args.command](args)
    except (CliError, ScheduleError, ValueError) as exc:
        print(f"duplexpipe: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("duplexpipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `duplexpipe show ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
