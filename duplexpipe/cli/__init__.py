"""The `duplexpipe` command: one module per command group, argparse glue over library calls."""

import sys

try:
    from duplexpipe.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules load: one line, as main says it later
    print("duplexpipe: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

__all__ = ["main"]
