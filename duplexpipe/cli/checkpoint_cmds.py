"""The `checkpoint` command group: `checkpoint verify DIR` checks a checkpoint's files without loading it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from duplexpipe.cli import help as docs
from duplexpipe.cli.args import CliError, Parser, command


def add_parsers(sub: Any) -> None:
    """Add `checkpoint` and its subcommands to the `duplexpipe` subcommands (parsing them needs no torch)."""
    group = command(sub, "checkpoint", "check training checkpoints (verify)")
    actions = group.add_subparsers(dest="checkpoint_command", metavar="ACTION", parser_class=Parser)
    actions.required = True
    verify = actions.add_parser("verify", help="check a checkpoint's files against its manifest, without loading it",
                                description=docs.DESCRIPTIONS["checkpoint verify"],
                                epilog=docs.EPILOGS["checkpoint verify"],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("path", metavar="DIR", help="a checkpoint folder (step-NNNNNN), or a --save folder: the "
                        "checkpoint its 'latest' file names")
    verify.add_argument("--all", action="store_true", help="with a --save folder: every step-NNNNNN checkpoint in it")


def _targets(path: str, every: bool) -> list[str]:
    """The checkpoint folders to check: `path` itself, the one its `latest` names, or (--all) every step folder."""
    from duplexpipe.launch.checkpoints import latest_checkpoint, step_folders

    root = Path(path)
    if not root.is_dir():
        raise CliError(f"{path} is not a folder")
    if every:
        found = [str(p) for p in step_folders(root)]
        if not found:
            raise CliError(f"{path} holds no step-NNNNNN checkpoint folders")
        return found
    try:
        latest = latest_checkpoint(path)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return [str(latest)] if latest is not None else [path]


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """`duplexpipe checkpoint verify`: 0 when every checked checkpoint is intact, 1 when one is not (one line
    each), 2 for a path that is no checkpoint."""
    from duplexpipe.errors import CheckpointError
    from duplexpipe.train.checkpoint import verify_checkpoint

    bad = 0
    for target in _targets(args.path, args.all):
        try:
            problems, summary = verify_checkpoint(target)
        except CheckpointError as exc:
            raise CliError(str(exc)) from None
        if problems:
            bad += 1
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            print(f"DAMAGED {target}: {problems[0]}{more}")
            for problem in problems[1:]:
                print(f"  {problem}")
        else:
            print(f"OK {target}: {summary}")
    return 1 if bad else 0


COMMANDS = {"checkpoint": cmd_checkpoint}
