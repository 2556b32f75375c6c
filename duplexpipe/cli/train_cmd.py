"""The `duplexpipe train` command: its options (flags over a TOML file over defaults) and the summary it prints."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import IO, Any

from duplexpipe.cli.args import parse_task_options
from duplexpipe.fielddoc import field_docs
from duplexpipe.launch.train_config import (
    BALANCES,
    DEFAULT_TASK,
    GRAD_COMPRESSIONS,
    HF_TASK,
    LR_SCHEDULES,
    OPTIMIZERS,
    P2P_COMPRESSIONS,
    PRECISIONS,
    ZERO_STAGES,
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
    """The options of `duplexpipe train`. Flags left out keep the config file's value, else the default. Each
    flag's help is its TrainConfig field's docstring (one text for `help(TrainConfig)` and `--help`)."""
    d = TrainConfig()
    docs = field_docs(TrainConfig)
    add = parser.add_argument

    def about(name: str) -> str:
        return f"{docs.get(name, name.replace('_', ' '))} (default {getattr(d, name)})"

    def opt(flag: str, kind: Any, what: str | None = None, **extra: Any) -> None:  # what: for a flag without
        # a TrainConfig field of its own
        name = flag.lstrip("-").replace("-", "_")
        add(flag, type=kind, default=argparse.SUPPRESS, dest=name,
            help=f"{what} (default {getattr(d, name)})" if what else about(name), **extra)

    add("--config", default=None, metavar="FILE.toml",
        help="TOML file of settings named like the flags with underscores (batch_size = 64, [task_options]); "
             "flags given here override it")
    add("--task", default=argparse.SUPPRESS, help=about("task"))
    add("--task-option", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE", dest="task_options",
        help=f"{docs.get('task_options', '')} Repeatable, e.g. n_layer=8.")
    opt("--schedule", str)
    opt("--ranks", int)
    opt("--dp", int)
    opt("--tp", int)
    opt("--microbatches", int)
    opt("--steps", int)
    opt("--batch-size", int)
    opt("--optimizer", str, choices=OPTIMIZERS)
    opt("--lr", float)
    opt("--weight-decay", float)
    opt("--momentum", float)
    opt("--lr-schedule", str, choices=LR_SCHEDULES)
    opt("--warmup", int)
    opt("--min-lr-ratio", float)
    opt("--precision", str, choices=PRECISIONS)
    opt("--p2p-compression", str, choices=P2P_COMPRESSIONS)
    opt("--grad-compression", str, choices=GRAD_COMPRESSIONS)
    opt("--zero-stage", int, choices=ZERO_STAGES)
    opt("--memory-limit", str)
    opt("--grad-clip-norm", float)
    opt("--balance", str, choices=BALANCES)
    opt("--seed", int)
    opt("--log-every", int)
    opt("--out-dir", str)
    opt("--save", str)
    opt("--save-every", int)
    opt("--keep", int)
    opt("--resume", str)
    opt("--save-pretrained", str)
    add("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS", help=about("timeout_s"))
    add("--activation-checkpointing", action="store_true", default=argparse.SUPPRESS,
        help=about("activation_checkpointing"))
    add("--compile", action="store_true", default=argparse.SUPPRESS, help=about("compile"))
    opt("--compile-backend", str)
    add("--progress", action="store_true", default=argparse.SUPPRESS, help=about("progress"))
    add("--sequence-parallel", action="store_true", default=argparse.SUPPRESS, help=about("sequence_parallel"))
    add("--no-tensorboard", action="store_false", dest="tensorboard", default=argparse.SUPPRESS,
        help=about("tensorboard"))


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


def _check_without_torch(config: TrainConfig) -> None:
    """The schedule with its ranks and microbatches, and the task file's existence: found in well under a
    second (the checks after these import torch)."""
    from duplexpipe.schedules.registry import build as build_schedule

    if config.schedule != "auto":
        build_schedule(config.schedule, config.ranks, config.microbatches)
    target, sep, name = config.task.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"task {config.task!r} must look like 'path/to/file.py:function' or 'module:function'")
    if target.endswith(".py") and not Path(target).is_file():
        raise ValueError(f"task file {target!r} does not exist")


def train_main(args: argparse.Namespace, stream: IO[str] | None = None) -> int:
    """`duplexpipe train`: run training and write a summary to `stream` (stdout); returns the exit code."""
    config = config_from_args(args)
    _check_without_torch(config)
    from duplexpipe.launch.checks import check_training  # imports torch: after the checks that need none
    from duplexpipe.launch.train_loop import run_training

    try:
        check_training(config)  # every configuration error, before any process starts
        _check_files(config)
    except ValueError as exc:
        from duplexpipe.errors import InputRejected

        raise InputRejected(str(exc)) from exc
    result = run_training(config)
    out = stream or sys.stdout
    if result.losses:
        if config.schedule == "auto":
            out.write(f"{result.plan}\n")
        if result.partition:
            out.write(f"{result.partition}\n")
        done = f"steps {result.start_step + 1}-{config.steps}" if result.start_step else f"{config.steps} steps"
        chosen = f" (chose {result.schedule})" if config.schedule == "auto" and result.schedule else ""
        tensor = f" x {config.tp} tp" if config.tp > 1 else ""
        out.write(f"{config.schedule}{chosen} on {config.ranks} ranks x {config.dp} dp{tensor}, {done}: loss "
                  f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}, {result.items_per_s:,.0f} items/s, "
                  f"{result.wall_s:.1f}s\n")
        if result.send_bytes:
            out.write(f"stage-to-stage sends ({config.p2p_compression}): {result.send_bytes:,.0f} bytes each "
                      f"on rank 0\n")
        if result.timeline is not None:
            out.write(f"last step: makespan {result.timeline.makespan * 1e3:.1f} ms, "
                      f"bubble ratio {result.timeline.bubble_ratio:.1%}\n")
    return 0


def _check_files(config: TrainConfig) -> None:
    """The hf task's options, the --save-pretrained target and the checkpoint to resume from: ValueError before
    any process starts or anything is written."""
    from duplexpipe.launch.checkpoints import resume_from

    if config.task == HF_TASK:
        from duplexpipe.launch.tasks.hf import check_options

        check_options(**config.task_options)
    if config.save_pretrained is not None:
        if config.task == DEFAULT_TASK:
            raise ValueError("--save-pretrained writes a Hugging Face model; the gpt task trains none (use --task hf)")
        if Path(config.save_pretrained).exists() and not Path(config.save_pretrained).is_dir():
            raise ValueError(f"--save-pretrained {config.save_pretrained} exists and is not a directory")
    resume_from(config.resume, config.save)


def cmd_train(args: argparse.Namespace) -> int:
    """`duplexpipe train`: exit 2 with one line for a configuration error, 1 with the failed rank's error in
    one line when a rank fails. Under torchrun the ranks settle who reports (launch.failures): that rank
    logs its error (torchrun's summary shows its traceback), every other rank one line, and exits quietly."""
    try:
        return train_main(args)
    except Exception as exc:
        code = _failed(exc)
        if code is None:
            raise
        return code


def _failed(exc: Exception) -> int | None:
    """The exit code for a failed run, once its one line is out; None: main reports `exc` (configuration
    errors exit 2 with one line, anything else is a bug and shows its traceback)."""
    torchrun = all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if "torch" not in sys.modules and not torchrun:  # before the training stack was imported: configuration
        return None
    from duplexpipe.errors import InputRejected, LaunchError, StoppedByPeer
    from duplexpipe.launch.failures import record_failure, reported

    if isinstance(exc, StoppedByPeer):
        return 0 if exc.same_node else 1
    if isinstance(exc, LaunchError):
        rejected = f"{InputRejected.__name__}: "
        if exc.summary.startswith(rejected):  # a rank rejected its input (a checkpoint that does not match)
            print(f"duplexpipe: error: {exc.summary[len(rejected):]}", file=sys.stderr)
            return 2
        print(f"duplexpipe: error: rank {exc.rank} failed: {exc.summary}", file=sys.stderr)
        return 1
    if reported(exc):
        return 1
    if torchrun and isinstance(exc, InputRejected):  # every rank found it before training: rank 0 reports it
        settled = record_failure(exc, int(os.environ["RANK"]), with_traceback=False)
        return 2 if settled.cause is None else 0 if settled.same_node else 1
    return None


COMMANDS = {"train": cmd_train}
