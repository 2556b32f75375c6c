"""Ready-made training runs of a task (model + data) on local processes or torchrun; `duplexpipe train`."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.pipeline.launch import run
from duplexpipe.pipeline.mesh import make_mesh
from duplexpipe.pipeline.trainer import LossFn, OptimizerFactory, Pipeline, PipelineConfig
from duplexpipe.schedules.registry import build as build_schedule
from duplexpipe.schedules.timeline import Timeline

DEFAULT_TASK = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py") + ":gpt_task"


@dataclass
class TrainTask:
    """A model and its data, built on every rank by the task function."""

    layers: Sequence[nn.Module]
    """The blocks to split over the model parts (an nn.Sequential works too)."""
    loss_fn: LossFn
    """loss_fn(output, targets) -> mean loss of a microbatch."""
    batch: Callable[[int], tuple[Any, Any]]
    """batch(step) -> (inputs, targets): the global batch of `step`, identical on every rank."""
    optimizer: OptimizerFactory
    """Builds the optimizer from a rank's parameters."""
    embedding: nn.Module | None = None
    """Runs before the first block, in model part 0."""
    head: nn.Module | None = None
    """Runs after the last block, in the last model part."""
    items_per_sample: int = 1
    """Items (e.g. tokens) per sample, for the throughput figure."""
    item_name: str = "samples"
    """What an item is called in the progress line."""


@dataclass
class TrainConfig:
    """One training run."""

    task: str = DEFAULT_TASK
    """"path/to/file.py:function" or "package.module:function" returning a TrainTask."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the task function."""
    schedule: str = "dualpipe"
    """Schedule name from the registry."""
    ranks: int = 4
    """Pipeline ranks (processes per data-parallel replica)."""
    dp: int = 1
    """Data-parallel replicas; ranks * dp processes in all."""
    microbatches: int = 8
    """Microbatches per step."""
    steps: int = 60
    """Training steps."""
    precision: str = "fp32"
    """"fp32", "bf16" or "fp16"."""
    grad_clip_norm: float | None = 1.0
    """Global gradient-norm clip (None: off)."""
    activation_checkpointing: bool = False
    """Recompute every stage's activations in backward."""
    balance: str = "uniform"
    """"uniform", "params" or "time" (profiled on the first microbatch of step 0's batch)."""
    seed: int = 0
    """Torch seed set on every rank before the task is built."""
    progress: bool = False
    """Rank 0 writes a one-line progress display (step, loss, items/s) to stdout."""
    out_dir: str | None = None
    """Write losses.json, timeline.json and partition.txt here (None: nothing is written)."""
    timeout_s: float = 180.0
    """Runtime timeout for blocked communication."""

    def parts_needed(self) -> int:
        """How many model parts the schedule needs (the model needs at least that many blocks)."""
        return build_schedule(self.schedule, self.ranks, self.microbatches).num_groups


@dataclass
class TrainResult:
    """What a training run produced (on rank 0 of the run)."""

    losses: list[float]
    """Mean loss of every step."""
    items_per_s: float
    """Throughput after the first (warm-up) step, in the task's items (tokens for the GPT)."""
    timeline: Timeline | None
    """The last step's measured timeline, gathered from all pipeline ranks (dp replica 0)."""
    partition: str
    """The partition report."""
    wall_s: float
    """Seconds the training loop took on rank 0."""
    config: TrainConfig
    """The configuration that ran."""

    @property
    def tokens_per_s(self) -> float:
        """Alias of items_per_s for token-level tasks."""
        return self.items_per_s


def load_task(spec: str) -> Callable[..., TrainTask]:
    """Resolve "file.py:function" or "module:function" to the task function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"task {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"task file {target!r} does not exist")
        module_name = f"duplexpipe_task_{path.stem}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise TypeError(f"task {spec!r}: {target} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


class ProgressLine:
    """A carriage-return progress display: one line, rewritten each step."""

    def __init__(self, total: int, unit: str, stream: IO[str]) -> None:
        self.total, self.unit, self.stream = total, unit, stream

    def update(self, step: int, loss: float, rate: float) -> None:
        """Show step (1-based), loss and throughput."""
        width = 24
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        rate_text = f"{rate:,.0f} {self.unit}/s" if rate > 0 else "warming up"
        self.stream.write(f"\r[{bar}] step {step}/{self.total}  loss {loss:.4f}  {rate_text}   ")
        self.stream.flush()

    def close(self) -> None:
        """End the line."""
        self.stream.write("\n")
        self.stream.flush()


def _local_slice(value: Any, index: int, parts: int) -> Any:
    if parts == 1 or value is None:
        return value
    size = value.shape[0] // parts
    return value[index * size:(index + 1) * size]


def _train_rank(config: TrainConfig) -> TrainResult | None:
    """One rank of `run_training` (the default process group is initialised)."""
    from duplexpipe.runtime import gather_timeline

    if dist.get_world_size() != config.ranks * config.dp:
        raise ValueError(f"{dist.get_world_size()} processes, but ranks x dp = {config.ranks} x {config.dp}")
    torch.manual_seed(config.seed)
    task = load_task(config.task)(**config.task_options)
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    mesh = make_mesh(config.ranks, config.dp, device_type) if config.dp > 1 else None
    pcfg = PipelineConfig(schedule=config.schedule, num_microbatches=config.microbatches,
                          precision=config.precision, grad_clip_norm=config.grad_clip_norm,
                          activation_checkpointing=config.activation_checkpointing,
                          timeout_s=config.timeout_s)
    first_inputs = task.batch(0)[0]  # one microbatch of it is the profiling sample for the report
    sample = first_inputs[: max(1, first_inputs.shape[0] // (config.microbatches * config.dp))]
    pipe = Pipeline.from_layers(task.layers, task.loss_fn, task.optimizer, pcfg, embedding=task.embedding,
                                head=task.head, balance=config.balance, sample_input=sample, mesh=mesh)
    lead = dist.get_rank() == 0
    bar = ProgressLine(config.steps, task.item_name, sys.stdout) if config.progress and lead else None
    losses: list[float] = []
    start = time.perf_counter()
    warm = start
    items = 0
    for step in range(config.steps):
        x, y = task.batch(step)
        x, y = (_local_slice(v, pipe.groups.dp_rank, pipe.groups.dp_size) for v in (x, y))
        losses.append(pipe.step(x, y))
        if step == 0:
            warm = time.perf_counter()
        else:
            items += int(x.shape[0]) * pipe.groups.dp_size * task.items_per_sample
        rate = items / (time.perf_counter() - warm) if step else 0.0
        if bar is not None:
            bar.update(step + 1, losses[-1], rate)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    last = pipe.last.timeline if pipe.last is not None else None
    timeline = gather_timeline(last, group=pipe.groups.pp_group) if last is not None else None
    rate = items / (end - warm) if items else 0.0
    partition = str(pipe.partition) if pipe.partition is not None else ""
    if not lead:
        return None
    return TrainResult(losses, rate, timeline, partition, end - start, config)


def write_outputs(result: TrainResult, out_dir: str) -> None:
    """losses.json, timeline.json and partition.txt in `out_dir`."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    summary = {"losses": result.losses, "items_per_s": result.items_per_s, "wall_s": result.wall_s,
               "config": asdict(result.config)}
    (path / "losses.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if result.timeline is not None:
        (path / "timeline.json").write_text(json.dumps(result.timeline.to_dict()) + "\n", encoding="utf-8")
    (path / "partition.txt").write_text(result.partition + "\n", encoding="utf-8")


def run_training(config: TrainConfig) -> TrainResult:
    """Train `config.task` on ranks * dp local processes (or in place under torchrun); rank 0's result.

    Under torchrun, non-zero ranks get a TrainResult with empty losses.
    """
    if config.ranks < 1 or config.dp < 1 or config.steps < 1:
        raise ValueError(f"ranks, dp and steps must be >= 1, got {config.ranks}, {config.dp}, {config.steps}")
    results = run(_train_rank, config.ranks * config.dp, (config,), timeout_s=None)
    result = results[0]
    if result is None:
        return TrainResult([], 0.0, None, "", 0.0, config)
    if config.out_dir:
        write_outputs(result, config.out_dir)
    return result


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `duplexpipe train` (names match TrainConfig fields)."""
    d = TrainConfig()
    parser.add_argument("--task", default=d.task,
                        help="'file.py:function' or 'module:function' returning a TrainTask "
                        "(default: the GPT example)")
    parser.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the task function (repeatable), e.g. n_layer=8")
    parser.add_argument("--schedule", default=d.schedule, help="schedule name (default %(default)s)")
    parser.add_argument("--ranks", type=int, default=d.ranks, help="pipeline ranks (default %(default)s)")
    parser.add_argument("--dp", type=int, default=d.dp, help="data-parallel replicas (default %(default)s)")
    parser.add_argument("--microbatches", type=int, default=d.microbatches,
                        help="per step (default %(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps (default %(default)s)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=d.precision)
    parser.add_argument("--grad-clip-norm", type=float, default=d.grad_clip_norm,
                        help="global gradient-norm clip, 0 for none (default %(default)s)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute activations")
    parser.add_argument("--balance", choices=("uniform", "params", "time"), default=d.balance)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out-dir", default=None,
                        help="write losses.json, timeline.json and partition.txt here")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="communication timeout in seconds")


def parse_task_options(items: Sequence[str]) -> dict[str, Any]:
    """["n_layer=8", "lr=1e-3", "name=abc"] -> {"n_layer": 8, "lr": 0.001, "name": "abc"}."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"task option {item!r} must look like KEY=VALUE")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from the options of `add_train_arguments`."""
    clip = args.grad_clip_norm if args.grad_clip_norm else None
    return TrainConfig(task=args.task, task_options=parse_task_options(args.task_option),
                       schedule=args.schedule, ranks=args.ranks, dp=args.dp,
                       microbatches=args.microbatches, steps=args.steps, precision=args.precision,
                       grad_clip_norm=clip, activation_checkpointing=args.activation_checkpointing,
                       balance=args.balance, seed=args.seed, progress=not args.no_progress,
                       out_dir=args.out_dir, timeout_s=args.timeout)


def train_main(args: argparse.Namespace, stream: IO[str] | None = None) -> int:
    """`duplexpipe train`: run training and write a summary to `stream` (stdout); returns the exit code."""
    config = config_from_args(args)
    for name in ("ranks", "dp", "microbatches", "steps"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(config, name)}")
    config.parts_needed()  # builds the schedule: a bad name, P or M fails here, before any process starts
    result = run_training(config)
    out = stream or sys.stdout
    if result.losses:
        out.write(f"{result.partition}\n")
        out.write(f"{config.schedule} on {config.ranks} ranks x {config.dp} dp, {config.steps} steps: loss "
                  f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}, {result.items_per_s:,.0f} items/s, "
                  f"{result.wall_s:.1f}s\n")
        if result.timeline is not None:
            out.write(f"last step: makespan {result.timeline.makespan * 1e3:.1f} ms, "
                      f"bubble ratio {result.timeline.bubble_ratio:.1%}\n")
    return 0
