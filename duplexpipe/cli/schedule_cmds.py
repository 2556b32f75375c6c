"""The `schedules`, `show`, `verify` and `export` commands: list, print, check and write schedules."""

from __future__ import annotations

import argparse
from typing import Any

from duplexpipe.cli.args import CliError, add_cost, add_schedule, add_zero3, check_output, command, schedule_of
from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import save_json, save_torch_csv


def add_parsers(sub: Any) -> None:
    """Add `schedules`, `show`, `verify` and `export` to the `duplexpipe` subcommands."""
    command(sub, "schedules", "list the built-in schedules, their constraints and options")
    show = command(sub, "show", "print a schedule's rank x step grid")
    add_schedule(show)
    show.add_argument("--comms", action="store_true", help="show the lowered schedule with SEND/RECV")
    add_zero3(show)
    add_cost(show, planning_only=True)
    ver = command(sub, "verify", "check completeness, ordering and deadlock freedom (exit 1 if unsound)")
    add_schedule(ver)
    ver.add_argument("--nccl", action="store_true", help="also check that every two ranks post the messages "
                     "between them in one order (NCCL runs both directions on one stream)")
    add_zero3(ver)
    add_cost(ver, planning_only=True)
    exp = command(sub, "export", "write a schedule as JSON or torch CSV")
    add_schedule(exp)
    exp.add_argument("--format", choices=("json", "torch-csv"), required=True,
                     help="json: duplexpipe's, with the stage table; torch-csv: one row of actions per rank, "
                          "the schedule CSV torch.distributed.pipelining writes and reads")
    exp.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")
    exp.add_argument("--comms", action="store_true", help="export the lowered schedule (with SEND/RECV)")
    add_zero3(exp)
    add_cost(exp, planning_only=True)


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

    schedule = schedule_of(args)
    if args.comms and not schedule.has_comms:
        schedule = lower(schedule)
    print(render_text(schedule))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.verify import verify

    schedule = schedule_of(args)
    try:
        verify(schedule, nccl=args.nccl)
    except ScheduleError as exc:
        print(f"UNSOUND {schedule.name}: {exc}")
        return 1
    print(f"OK {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_microbatches} microbatches, "
          f"{schedule.num_stages} stages: complete, ordered, deadlock-free{', NCCL pair order' if args.nccl else ''}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from duplexpipe.schedules.lower import lower

    check_output(args.output, "-o")
    schedule = schedule_of(args)
    if args.format == "torch-csv" and schedule.num_copies > 1:
        raise CliError(f"{schedule.name} runs {schedule.num_copies} model copies; a torch CSV has no stage table "
                       "to say so (a reader would see one chain of stages and find actions missing): use "
                       "--format json")
    if args.comms:
        schedule = lower(schedule)
    (save_json if args.format == "json" else save_torch_csv)(schedule, args.output)
    print(f"wrote {schedule.name} ({args.format}) to {args.output}")
    return 0


COMMANDS = {"schedules": _cmd_schedules, "show": _cmd_show, "verify": _cmd_verify, "export": _cmd_export}
