"""The `duplexpipe` command: one module per command group, argparse glue over library calls."""

from duplexpipe.cli.main import main

__all__ = ["main"]
