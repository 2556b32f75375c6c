"""The `duplexpipe train` command: its options (flags over a TOML file over defaults) and the summary it prints."""

from __future__ import annotations

import argparse
import sys
from typing import IO, Any

from duplexpipe.cli.args import parse_task_options
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
        "TrainTask, or a bundled task: 'gpt' (the default: a small GPT on a bundled corpus) or 'hf' (fine-tune a "
        "Hugging Face model directory on a text file: --task-option model=DIR --task-option data=FILE)")
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
    opt("--grad-compression", str, "data-parallel gradient compression", choices=GRAD_COMPRESSIONS)
    opt("--zero-stage", int, "ZeRO stage over the data-parallel replicas", choices=ZERO_STAGES)
    opt("--memory-limit", str, "bytes per rank for --schedule auto's planner, e.g. 2GiB")
    opt("--grad-clip-norm", float, "global gradient-norm clip, 0 for none")
    opt("--balance", str, "how to split the layers", choices=BALANCES)
    opt("--seed", int, "torch seed")
    opt("--log-every", int, "print a line every N steps, 0 for none")
    opt("--out-dir", str, "write metrics.jsonl, losses.json, timeline.json, partition.txt (and TensorBoard) here")
    opt("--save", str, "save checkpoints under this directory (a restarted job resumes from its newest)")
    opt("--save-every", int, "also save every N steps")
    opt("--keep", int, "keep the newest K checkpoints, 0 for all")
    opt("--resume", str, "'auto' (the default with --save: the newest complete checkpoint of --save, else a fresh "
        "start), 'none', or a checkpoint or save directory to continue from")
    opt("--save-pretrained", str, "at the end, write the model as a Hugging Face directory here (task hf)")
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
    from duplexpipe.launch.train_loop import run_training

    config = config_from_args(args)
    check_before_start(config)
    result = run_training(config)
    out = stream or sys.stdout
    if result.losses:
        if result.partition:
            out.write(f"{result.partition}\n")
        done = f"steps {result.start_step + 1}-{config.steps}" if result.start_step else f"{config.steps} steps"
        chosen = f" (chose {result.schedule})" if config.schedule == "auto" and result.schedule else ""
        out.write(f"{config.schedule}{chosen} on {config.ranks} ranks x {config.dp} dp, {done}: loss "
                  f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}, {result.items_per_s:,.0f} items/s, "
                  f"{result.wall_s:.1f}s\n")
        if result.send_bytes:
            out.write(f"stage-to-stage sends ({config.p2p_compression}): {result.send_bytes:,.0f} bytes each "
                      f"on rank 0\n")
        if result.timeline is not None:
            out.write(f"last step: makespan {result.timeline.makespan * 1e3:.1f} ms, "
                      f"bubble ratio {result.timeline.bubble_ratio:.1%}\n")
    return 0


def check_before_start(config: TrainConfig) -> None:
    """Raise ValueError for input that would fail in the ranks, before any process starts or anything is written:
    the schedule, the task, its options (task hf), the --save-pretrained target, the checkpoint to resume from."""
    from pathlib import Path

    from duplexpipe.launch.checkpoints import resume_from
    from duplexpipe.launch.train_loop import load_task, pipeline_config
    from duplexpipe.schedules.registry import build as build_schedule

    pipeline_config(config)  # the Pipeline's own checks (compression x ZeRO, ...)
    if config.schedule != "auto":
        build_schedule(config.schedule, config.ranks, config.microbatches)  # bad name, P or M
    load_task(config.task)
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
    """`duplexpipe train`: exit 2 with the message when a rank rejects its input (a ValueError: a checkpoint that
    does not match, ...), exit 1 with the failed rank's last line when a rank fails otherwise."""
    from duplexpipe.launch.processes import LaunchError

    try:
        return train_main(args)
    except LaunchError as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        if last.startswith("ValueError: "):
            print(f"duplexpipe: error: {last[len('ValueError: '):]}", file=sys.stderr)
            return 2
        print(f"duplexpipe: error: rank {exc.rank} failed: {last}", file=sys.stderr)
        return 1


COMMANDS = {"train": cmd_train}
