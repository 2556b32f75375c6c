"""The `duplexpipe` command: the parser made of every command group's, and `main`, the console script."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from duplexpipe.cli import checkpoint_cmds, plan_cmds, schedule_cmds, simulate_cmds, train_cmd
from duplexpipe.cli import help as docs
from duplexpipe.cli.args import CliError, Parser
from duplexpipe.errors import ScheduleError

COMMANDS = {**schedule_cmds.COMMANDS, **simulate_cmds.COMMANDS, **train_cmd.COMMANDS, **checkpoint_cmds.COMMANDS,
            "plan": plan_cmds.cmd_plan, "profile": plan_cmds.cmd_profile}
"""Command name -> handler(args) -> exit code."""


def build_parser(with_train: bool = False) -> Parser:
    """The whole parser; `train`'s options only `with_train` (generated from the config dataclasses: a walk of their
    fields that the other commands need not pay for)."""
    parser = Parser(prog="duplexpipe", description=docs.DESCRIPTIONS["duplexpipe"], epilog=docs.EPILOGS["duplexpipe"],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    schedule_cmds.add_parsers(sub)
    simulate_cmds.add_parsers(sub)
    train_cmd.add_parsers(sub, full=with_train)
    plan_cmds.add_parsers(sub)
    checkpoint_cmds.add_parsers(sub)
    return parser


def _fail(message: str) -> int:
    print(f"duplexpipe: error: {message}".splitlines()[0], file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `duplexpipe` console script; returns the exit code."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser(with_train="train" in argv).parse_args(argv)
        return COMMANDS[args.command](args)
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
    except Exception as exc:
        if not _interrupted(exc):
            raise
        print("duplexpipe: interrupted", file=sys.stderr)  # Ctrl-C, then a failure while cleaning up after it
        return 130


def _interrupted(exc: BaseException) -> bool:
    """True when `exc` was raised while handling a KeyboardInterrupt (its context or cause, at any depth)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
