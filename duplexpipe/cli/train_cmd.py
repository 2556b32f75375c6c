"""The `duplexpipe train` command: its options (flags over a TOML file over defaults) and the summary it prints."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import IO, Any

from duplexpipe.cli import help as docs
from duplexpipe.cli.args import CliError, check_size, load_schedule
from duplexpipe.config.pipeline import AUTO, DEFAULT_MICROBATCHES, is_schedule_file
from duplexpipe.launch.folder_lock import hold_folders, job_folders
from duplexpipe.launch.train_config import DEFAULT_TASK, HF_TASK, TrainConfig


def add_parsers(sub: Any, full: bool = True) -> None:
    """Add `train`; its options only when `full` (generated from the config dataclasses, torch-free); its epilog (the
    bundled tasks' options: imports the gpt task, hence torch) is made only when its help is shown."""
    train = sub.add_parser("train", help="train a model (default: the bundled GPT example) on local CPU "
                           "processes, or under torchrun", description=docs.DESCRIPTIONS["train"],
                           lazy_epilog=_epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    if full:
        add_train_arguments(train)


def _epilog() -> str:
    """Examples, the bundled tasks' options (from their signature and option fields) and the exit codes."""
    import inspect

    from duplexpipe.launch.tasks.gpt import gpt_task
    from duplexpipe.launch.tasks.hf_options import options_help

    gpt = ", ".join(f"{n}={p.default}" for n, p in inspect.signature(gpt_task).parameters.items())
    return docs.EPILOGS["train"].format(gpt=gpt, hf=options_help())


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `duplexpipe train`: `--config FILE.toml`, then one flag per TrainConfig field and per
    PipelineConfig field a run passes on, generated from the fields (`launch.train_settings`)."""
    from duplexpipe.launch.train_settings import add_arguments

    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="TOML file of TrainConfig's settings: its own at the top (batch_size = 64), a "
                             "section's in its table ([optimizer] lr = 1e-3, [pipeline] schedule = \"1f1b\", "
                             "[pipeline.data_parallel] zero_stage = 1), options as tables ([task_options], "
                             "[pipeline.schedule_options]); flags given here override it. Its task "
                             "is imported and run as Python: use config files you trust; a task it names must be a "
                             "function annotated '-> TrainTask'")
    add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from defaults < the --config file < the flags given on the command line. A schedule file states
    the ranks and microbatches: they default to its own, and must agree with it when given."""
    from duplexpipe.launch.train_settings import load_config_file, merge_config, values_from_args

    flags = values_from_args(args)
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    given = {**file_values, **flags}
    schedule = given.get("pipeline.schedule")
    if is_schedule_file(schedule):
        loaded = _schedule_file(schedule, given.get("ranks"), given.get("pipeline.num_microbatches"),
                                given.get("pipeline.schedule_options"))
        flags = {"ranks": loaded.num_ranks, "pipeline.num_microbatches": loaded.num_microbatches, **flags,
                 "pipeline.schedule": str(Path(schedule).resolve())}  # every rank reads the same file
    return merge_config(file_values, flags)


def _schedule_file(path: str, ranks: int | None, microbatches: int | None, options: Any) -> Any:
    """A schedule file, read and verified: CliError (one line) for a file that cannot be read, disagrees with the
    ranks or microbatches given, or cannot run (the verifier's first line and a pointer to `duplexpipe verify`)."""
    from duplexpipe.errors import ScheduleError
    from duplexpipe.schedules.verify import verify

    if options:
        raise CliError(f"--opt applies to built-in schedules; {path} is a file")
    schedule = load_schedule(path, None, None)
    for flag, given, actual in (("--ranks", ranks, schedule.num_ranks),
                                ("--microbatches", microbatches, schedule.num_microbatches)):
        if given is not None and given != actual:
            raise CliError(f"{flag} {given}, but the schedule file {path} is for {actual} {flag[2:]}; leave "
                           f"{flag} out (a schedule file states it)")
    try:
        verify(schedule)
    except ScheduleError as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        why = "; ".join(lines[:2]) if len(lines) > 1 and lines[1].startswith("cycle:") else lines[0]
        raise CliError(f"schedule file {path} cannot run: {why} ('duplexpipe verify {path}' shows each rank's "
                       "blocked action)") from None
    return schedule


def _check_without_torch(config: TrainConfig) -> None:
    """The schedule with its ranks and microbatches (a built-in one asked first whether it takes them, before it is
    built), and the task file's existence: found before torch is imported and the task is built (the checks after
    these build it)."""
    from duplexpipe.schedules import registry

    microbatches = config.pipeline.num_microbatches
    if config.pipeline.schedule != AUTO and not is_schedule_file(config.pipeline.schedule):
        schedule, options = str(config.pipeline.schedule), dict(config.pipeline.schedule_options or {})
        refusal = registry.check(schedule, config.ranks, microbatches or DEFAULT_MICROBATCHES, **options)
        if refusal is not None:
            raise CliError(refusal)
        check_size(schedule, config.ranks, microbatches or 1, options)
    if config.pipeline.schedule != AUTO:
        config.schedule_object()
    target, sep, name = config.task.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"task {config.task!r} must look like 'path/to/file.py:function' or 'module:function'")
    if target.endswith(".py") and not Path(target).is_file():
        raise ValueError(f"task file {target!r} does not exist")


def train_main(args: argparse.Namespace, stream: IO[str] | None = None) -> int:
    """`duplexpipe train`: run training and write a summary to `stream` (stdout); returns the exit code."""
    config = config_from_args(args)
    _check_without_torch(config)
    torchrun = all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    # the run's folders are locked for it from here (under torchrun by rank 0, once the ranks meet)
    with contextlib.nullcontext() if torchrun else hold_folders(job_folders(config)):
        return _train_checked(args, config, stream or sys.stdout)


def _train_checked(args: argparse.Namespace, config: TrainConfig, out: IO[str]) -> int:
    """Check everything the ranks would fail on (the task first: named by a config file it must be annotated), then
    train and print the summary."""
    from duplexpipe.launch.checks import check_training  # imports torch: after the checks that need none
    from duplexpipe.launch.metrics import check_wandb, memory_summary
    from duplexpipe.launch.train_loop import run_training
    from duplexpipe.launch.train_task import load_task

    try:
        if _task_from_file(args):
            load_task(config.task, annotated=True)  # before anything calls it
        _check_export_target(config)
        check_training(config)  # every configuration error, before any process starts
        check_wandb(config.metrics.wandb)
        _check_files(config)
    except ValueError as exc:
        from duplexpipe.errors import InputRejected

        raise InputRejected(str(exc)) from exc
    result = run_training(config)
    if result.losses:
        if config.pipeline.schedule == "auto":
            out.write(f"{result.plan}\n")
        if result.partition:
            out.write(f"{result.partition}\n")
        done = f"steps {result.start_step + 1}-{config.steps}" if result.start_step else f"{config.steps} steps"
        calls = config.pipeline.accumulation_steps
        done += f" of {calls} batches" if calls > 1 else ""
        chosen = f" (chose {result.schedule})" if config.pipeline.schedule == "auto" and result.schedule else ""
        schedule = config.pipeline.schedule
        name = Path(schedule).name if is_schedule_file(schedule) else str(schedule)
        evaluated = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
        out.write(f"{name}{chosen} on {layout(config, result.zero_stage)}, {done}: loss "
                  f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}{evaluated}, {result.items_per_s:,.0f} "
                  f"{result.item_name}/s, {result.wall_s:.1f}s\n")
        if result.send_bytes:
            sends = config.pipeline.precision.p2p_compression or "none"
            out.write(f"stage-to-stage sends ({sends}): {result.send_bytes:,.0f} bytes each on rank 0\n")
        for line in memory_summary(result.memory):
            out.write(f"{line}\n")
        if result.timeline is not None:
            out.write(f"last step: makespan {result.timeline.makespan * 1e3:.1f} ms, "
                      f"bubble ratio {result.timeline.bubble_ratio:.1%}\n")
    return 0


def layout(config: TrainConfig, zero_stage: int) -> str:
    """Every degree of a run in one phrase: "pp 2 x dp 2 x tp 1 x ep 1 (ZeRO 1, sequence parallel off)"."""
    sequence = "on" if config.pipeline.sequence_parallel else "off"
    return (f"pp {config.ranks} x dp {config.dp} x tp {config.tp} x ep {config.ep} (ZeRO {zero_stage}, sequence "
            f"parallel {sequence})")


def _task_from_file(args: argparse.Namespace) -> bool:
    """True when the task was named by the --config file, not by --task on the command line."""
    from duplexpipe.launch.train_settings import load_config_file

    config_file = getattr(args, "config", None)
    return "task" not in vars(args) and config_file is not None and "task" in load_config_file(config_file)


def _check_export_target(config: TrainConfig) -> None:
    """--save-pretrained naming the model folder the hf task loads: refused (before the task is built) unless
    --save-pretrained-overwrite."""
    if config.checkpoint.save_pretrained is not None and config.task == HF_TASK:
        from duplexpipe.train.checkpoint.hf_export import check_target

        source = config.task_options.get("model")
        check_target(config.checkpoint.save_pretrained, source if isinstance(source, str) else None,
                     config.checkpoint.save_pretrained_overwrite)


def _check_files(config: TrainConfig) -> None:
    """The hf task's options, the --save-pretrained target and the checkpoint to resume from (its metadata read the
    safe way: a crafted one is refused here): ValueError before any process starts or anything is written."""
    from duplexpipe.launch.checkpoints import RESUME_AUTO, resume_from
    from duplexpipe.train.checkpoint import read_checked_metadata
    from duplexpipe.train.checkpoint.names import format_problems

    if config.task == HF_TASK:
        from duplexpipe.launch.tasks.hf import check_options

        check_options(**config.task_options)
    if config.checkpoint.save_pretrained is not None:
        if config.task == DEFAULT_TASK:
            raise ValueError("--save-pretrained writes a Hugging Face model; the gpt task trains none (use --task hf)")
        if Path(config.checkpoint.save_pretrained).exists() and not Path(config.checkpoint.save_pretrained).is_dir():
            raise ValueError(f"--save-pretrained {config.checkpoint.save_pretrained} exists and is not a directory")
    if config.checkpoint.resume in (None, RESUME_AUTO) and config.checkpoint.save is not None:
        from duplexpipe.launch.processes import launched_by_torchrun
        from duplexpipe.launch.resume import intact_checkpoint

        if not launched_by_torchrun():  # under torchrun the ranks choose together, once they meet
            intact_checkpoint(config.checkpoint.save)  # past damaged ones: named, set aside; the ranks then agree
        return
    checkpoint = resume_from(config.checkpoint.resume, config.checkpoint.save)
    if checkpoint is not None:
        problems = format_problems(read_checked_metadata(checkpoint).state_dict_metadata)
        if problems:
            raise ValueError(f"checkpoint {checkpoint}: {problems[0]}")


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
        said = exc.summary if exc.summary.startswith(f"rank {exc.rank} ") else f"rank {exc.rank} failed: {exc.summary}"
        print(f"duplexpipe: error: {said}", file=sys.stderr)
        if exc.output_log is not None:
            print(f"duplexpipe: the ranks' whole output (torch's native log included) is in {exc.output_log}",
                  file=sys.stderr)
        return 1
    if reported(exc):
        return 1
    if torchrun and isinstance(exc, InputRejected):  # every rank found it before training: rank 0 reports it
        settled = record_failure(exc, int(os.environ["RANK"]), with_traceback=False)
        return 2 if settled.cause is None else 0 if settled.same_node else 1
    return None


COMMANDS = {"train": cmd_train}
