"""The `duplexpipe train` command: its options (flags over a TOML file over defaults) and the summary it prints."""

from __future__ import annotations

import argparse
import sys
from typing import IO, Any

from duplexpipe.cli.args import parse_task_options
from duplexpipe.launch.train_config import (
    BALANCES,
    LR_SCHEDULES,
    OPTIMIZERS,
    P2P_COMPRESSIONS,
    PRECISIONS,
    TrainConfig,
    load_config_file,
    merge_config,
)


def add_parsers(sub: Any, full: bool = True) -> None:
    """Add `train`; its options only when `full` (the training stack imports torch: only when needed)."""
    train = sub.add_parser("train", help="train a model (default: the bundled GPT example) on local CPU "
                           "processes, or under torchrun")
    if full:
        add_train_arguments(train)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `duplexpipe train`. Flags left out keep the config file's value, else the default."""
    d = TrainConfig()
    add = parser.add_argument

    def opt(flag: str, kind: Any, what: str, **extra: Any) -> None:
        name = flag.lstrip("-").replace("-", "_")
        add(flag, type=kind, default=argparse.SUPPRESS, dest=name, help=f"{what} (default {getattr(d, name)})",
            **extra)

    add("--config", default=None, metavar="FILE.toml",
        help="TOML file of settings named like the flags with underscores (batch_size = 64, [task_options]); "
             "flags given here override it")
    add("--task", default=argparse.SUPPRESS, help="'file.py:function' or 'module:function' returning a "
        f"TrainTask (default {d.task}: a small GPT on a bundled corpus)")
    add("--task-option", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE", dest="task_options",
        help="keyword argument for the task function (repeatable), e.g. n_layer=8")
    opt("--schedule", str, "schedule name")
    opt("--ranks", int, "pipeline ranks")
    opt("--dp", int, "data-parallel replicas")
    opt("--microbatches", int, "microbatches per step")
    opt("--steps", int, "training steps in all")
    opt("--batch-size", int, "samples per step over all replicas")
    opt("--optimizer", str, "optimizer", choices=OPTIMIZERS)
    opt("--lr", float, "peak learning rate")
    opt("--weight-decay", float, "weight decay")
    opt("--momentum", float, "SGD momentum")
    opt("--lr-schedule", str, "learning-rate schedule after warm-up", choices=LR_SCHEDULES)
    opt("--warmup", int, "linear warm-up steps")
    opt("--min-lr-ratio", float, "final lr / lr for cosine and linear decay")
    opt("--precision", str, "precision", choices=PRECISIONS)
    opt("--p2p-compression", str, "stage-to-stage send format", choices=P2P_COMPRESSIONS)
    opt("--grad-clip-norm", float, "global gradient-norm clip, 0 for none")
    opt("--balance", str, "how to split the layers", choices=BALANCES)
    opt("--seed", int, "torch seed")
    opt("--log-every", int, "print a line every N steps, 0 for none")
    opt("--out-dir", str, "write metrics.jsonl, losses.json, timeline.json, partition.txt (and TensorBoard) here")
    opt("--save", str, "save checkpoints under this directory")
    opt("--save-every", int, "also save every N steps")
    opt("--resume", str, "continue from this checkpoint or save directory")
    add("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
        help=f"communication timeout in seconds (default {d.timeout_s:.0f})")
    add("--activation-checkpointing", action="store_true", default=argparse.SUPPRESS, help="recompute activations")
    add("--progress", action="store_true", default=argparse.SUPPRESS, help="a progress bar instead of log lines")
    add("--no-tensorboard", action="store_false", dest="tensorboard", default=argparse.SUPPRESS,
        help="no TensorBoard scalars even when tensorboard is installed")


_FLAG_FIELDS = {f for f in TrainConfig.__dataclass_fields__} | {"timeout"}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from defaults < the --config file < the flags given on the command line."""
    flags = {k: v for k, v in vars(args).items() if k in _FLAG_FIELDS}
    if "timeout" in flags:
        flags["timeout_s"] = flags.pop("timeout")
    if "task_options" in flags:
        flags["task_options"] = parse_task_options(flags["task_options"])
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    return merge_config(file_values, flags)


def train_main(args: argparse.Namespace, stream: IO[str] | None = None) -> int:
    """`duplexpipe train`: run training and write a summary to `stream` (stdout); returns the exit code."""
    from duplexpipe.launch.train_loop import checkpoint_to_load, load_task, run_training
    from duplexpipe.schedules.registry import build as build_schedule

    config = config_from_args(args)
    if config.schedule != "auto":  # auto: the planner builds (and checks) its candidates
        build_schedule(config.schedule, config.ranks, config.microbatches)  # bad name, P or M: fail before spawning
    load_task(config.task)
    if config.resume is not None:
        checkpoint_to_load(config.resume)
    result = run_training(config)
    out = stream or sys.stdout
    if result.losses:
        if config.schedule == "auto":
            out.write(f"{result.plan}\n")
        out.write(f"{result.partition}\n")
        done = f"steps {result.start_step + 1}-{config.steps}" if result.start_step else f"{config.steps} steps"
        out.write(f"{config.schedule} on {config.ranks} ranks x {config.dp} dp, {done}: loss "
                  f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}, {result.items_per_s:,.0f} items/s, "
                  f"{result.wall_s:.1f}s\n")
        if result.send_bytes:
            out.write(f"stage-to-stage sends ({config.p2p_compression}): {result.send_bytes:,.0f} bytes each "
                      f"on rank 0\n")
        if result.timeline is not None:
            out.write(f"last step: makespan {result.timeline.makespan * 1e3:.1f} ms, "
                      f"bubble ratio {result.timeline.bubble_ratio:.1%}\n")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """`duplexpipe train`: exit 1 with the failed rank's last line when a rank fails."""
    from duplexpipe.launch.processes import LaunchError

    try:
        return train_main(args)
    except LaunchError as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        print(f"duplexpipe: error: rank {exc.rank} failed: {last}", file=sys.stderr)
        return 1


COMMANDS = {"train": cmd_train}
