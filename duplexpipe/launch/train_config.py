"""`duplexpipe train`'s run configuration: TrainConfig and its sections (the pipeline's: PipelineConfig), the LR;
torch-free, as the pipeline's config is (the command line builds and checks it before torch is imported)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from duplexpipe.config.pipeline import PipelineConfig, resolve_schedule, with_defaults
from duplexpipe.config.sections import DataParallelConfig
from duplexpipe.fielddoc import documented

DEFAULT_TASK = "duplexpipe.launch.tasks.gpt:gpt_task"
"""The bundled GPT task (package data: works from an installed wheel)."""
HF_TASK = "duplexpipe.launch.tasks.hf:hf_task"
"""The bundled Hugging Face fine-tuning task (options model=DIR, data=FILE)."""
TASK_ALIASES = {"gpt": DEFAULT_TASK, "hf": HF_TASK}
"""Short names of the bundled tasks for `task`."""
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")
BALANCES = ("uniform", "params", "time")
ZERO_STAGES = (0, 1, 2, 3)
NONFINITE_POLICIES = ("raise", "skip")
"""`nonfinite_grads` values (duplexpipe.train.nonfinite.NONFINITE_GRADS): stop the run, or skip the step and go on."""
DEFAULT_SCHEDULE = "dualpipe"
"""The schedule of a run that names none."""
DEFAULT_RUN_MICROBATCHES = 8
"""The microbatches of a run that names none (the pipeline's own default is `DEFAULT_MICROBATCHES`)."""
BATCH_CHECKS = ("first", "every", "never")
"""`batch_check` values: compare the batch's fingerprint across ranks on a run's first step, on every step, never."""
MAX_BATCH_SIZE = 2**20
"""Most samples a step's batch may hold (`batch_size`): a larger one is a typo that would build the batch until memory
runs out; a run that needs more samples per optimizer step accumulates (`accumulation_steps`)."""
MAX_EVAL_BATCHES = 10_000
"""Most held-out batches one evaluation runs (`eval_batches`)."""
MAX_SEED = 2**63 - 1
"""Largest seed (torch's generators take a signed 64-bit seed)."""
CHOICES: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "optimizer.name": OPTIMIZERS, "optimizer.lr_schedule": LR_SCHEDULES, "pipeline.precision.dtype": PRECISIONS,
    "balance": BALANCES, "pipeline.data_parallel.zero_stage": ZERO_STAGES,
    "pipeline.safety.nonfinite_grads": NONFINITE_POLICIES, "batch_check": BATCH_CHECKS})
"""The values some settings take, by key (the command line offers them as choices)."""


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@documented
@dataclass
class OptimizerConfig:
    """The optimizer and its learning-rate schedule."""

    name: str = "adamw"
    """"adamw" or "sgd" (with `momentum`)."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    momentum: float = 0.9
    """SGD momentum (optimizer "sgd" only)."""
    lr_schedule: str = "constant"
    """After warm-up: "constant", "cosine" or "linear" decay to `min_lr_ratio` x lr at the last step."""
    warmup: int = 0
    """Optimizer steps of linear warm-up from lr / warmup to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate over lr for the cosine and linear schedules."""

    def __post_init__(self) -> None:
        for name, choices in (("name", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"optimizer {name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        _at_least("warmup", self.warmup, 0)
        for name in ("lr", "weight_decay"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"optimizer {name} must be a finite number, got {getattr(self, name)}")
        if not self.lr > 0 or self.weight_decay < 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"need lr > 0, weight_decay >= 0 and 0 <= momentum < 1, got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}, momentum={self.momentum}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def profile_range(text: str) -> tuple[int, int]:
    """`MetricsConfig.profile_steps` "A:B" as (A, B), 1-based and inclusive; ValueError naming the text otherwise."""
    first, sep, last = text.partition(":")
    try:
        start, end = int(first), int(last)
    except ValueError:
        start, end = 0, -1
    if not sep or not 1 <= start <= end:
        raise ValueError(f"profile_steps must be A:B, steps 1 <= A <= B (e.g. 3:5), got {text!r}")
    return start, end


@documented
@dataclass
class MetricsConfig:
    """What the run reports, and where it writes it."""

    log_every: int = 10
    """Rank 0 prints step, loss, lr and throughput every N steps and at the last one (0: never)."""
    eval_every: int = 0
    """Evaluate every N steps and after the last one: the mean loss over `eval_batches` held-out batches of the
    task (`TrainTask.eval_batch`), in the step log, metrics.jsonl and TensorBoard (0: never)."""
    eval_batches: int = 4
    """Held-out batches of `batch_size` samples per evaluation (the same batches every time)."""
    progress: bool = False
    """A progress bar (tqdm) instead of the log lines when the output is a terminal; to a file or a pipe, plain
    log lines (every `log_every` steps, or about 20 over the run when that is 0)."""
    out_dir: str | None = None
    """Write metrics.jsonl (one line per step), losses.json, timeline.json, partition.txt and, when the
    tensorboard package is installed, TensorBoard scalars (tensorboard/) here (None: nothing is written). Locked
    for the run (.duplexpipe.lock): a second run on it exits with code 2 naming the holder."""
    tensorboard: bool = True
    """TensorBoard scalars under out_dir/tensorboard when the tensorboard package is installed (without it the run
    says so in one line and goes on); --no-tensorboard turns them off."""
    wandb: bool | dict[str, Any] = False
    """Weights & Biases: the TensorBoard scalars also to a wandb run (the `wandb` package: pip install
    'duplexpipe[wandb]'), with wandb.init's options as KEY=VALUE (project=NAME, mode=offline, name=..., ...); its
    files go to out_dir when given, and the run's config is TrainConfig's. Offline (no account, no network):
    mode=offline or WANDB_MODE=offline; `wandb sync` uploads it later."""
    profile_steps: str | None = None
    """"A:B": trace steps A to B (1-based, inclusive) with torch.profiler; each rank writes
    out_dir/profile/rank-N.json, a Chrome trace (ui.perfetto.dev opens it). Needs out_dir."""
    timeline_every: int = 0
    """Every N steps, gather every pipeline rank's measured timeline of that step (a pickled all-gather of the
    events) and write it to out_dir/timelines/step-NNNNNN.json (0: never; the bubble figure of every step comes
    from one small all-gather of each rank's busy and elapsed seconds, and the last step's timeline is gathered
    once at the end for timeline.json)."""

    def __post_init__(self) -> None:
        for name in ("log_every", "eval_every", "timeline_every"):
            _at_least(name, getattr(self, name), 0)
        _at_least("eval_batches", self.eval_batches, 1)
        if self.eval_batches > MAX_EVAL_BATCHES:
            raise ValueError(f"eval_batches must be <= {MAX_EVAL_BATCHES:,} (each evaluation runs them all), got "
                             f"{self.eval_batches:,}")
        if self.profile_steps is not None:
            profile_range(self.profile_steps)
            if self.out_dir is None:
                raise ValueError(f"profile_steps {self.profile_steps!r} writes its traces to out_dir: give --out-dir")


@documented
@dataclass
class CheckpointConfig:
    """Saving, resuming and exporting the trained model."""

    save: str | None = None
    """Save checkpoints to <save>/step-NNNNNN at the end; <save>/latest names the newest complete one (written
    atomically once every rank finished its part and the checkpoint's manifest of SHA-256 checksums is written).
    Locked for the run (.duplexpipe.lock): a second run on it exits with code 2 naming the holder. A save that fails
    (a full disk, ...) removes its partial folder and names the cause and the file. With `resume` "auto" (the
    default) the run continues from the newest checkpoint already there: its files are checked against its manifest
    and loading it never runs code (the metadata pickle admits only checkpoint classes)."""
    save_every: int = 0
    """Also save every N steps (0: only at the end)."""
    keep: int = 0
    """Keep the newest K checkpoints of `save` (0: all)."""
    resume: str | None = None
    """"auto" (the default with `save`): continue from the newest complete checkpoint of `save`, or start fresh
    when it has none (a job restarted by torchrun resumes by itself); "none": start fresh; a path: continue from
    that checkpoint or save directory (an error when it holds none). Loading checks every file against the
    checkpoint's manifest first and never runs code from it (its metadata pickle admits only checkpoint classes)."""
    save_pretrained: str | None = None
    """At the end, write the trained model here as a Hugging Face model directory (Hugging Face tasks only): into a
    new folder beside it, swapped in whole once written (a full disk leaves it as it was)."""
    save_pretrained_overwrite: bool = False
    """Let `save_pretrained` replace the model folder the run loaded its weights from (refused otherwise)."""

    def __post_init__(self) -> None:
        for name in ("save_every", "keep"):
            _at_least(name, getattr(self, name), 0)


def default_pipeline() -> PipelineConfig:
    """The pipeline of a run left at its defaults: DualPipe, 8 microbatches, gradients clipped to norm 1, ZeRO 0."""
    return PipelineConfig(DEFAULT_SCHEDULE, DEFAULT_RUN_MICROBATCHES, grad_clip_norm=1.0,
                          data_parallel=DataParallelConfig(zero_stage=0))


@documented
@dataclass
class TrainConfig:
    """One training run: the task, the mesh and the steps, and its sections (optimizer, metrics, checkpoint and the
    pipeline's own `PipelineConfig`); a field of a section is a key of that table in the TOML config file
    ([optimizer] lr = 1e-3, [pipeline.data_parallel] zero_stage = 1)."""

    task: str = DEFAULT_TASK
    """"path/to/file.py:function" or "package.module:function" returning a TrainTask, or a bundled task: "gpt" (the
    default) or "hf" (fine-tune a Hugging Face model directory on a text file: options model=DIR, data=FILE). The
    task's module is imported and the function called on every rank: this runs Python code (a task named in a
    config file must be a function annotated `-> TrainTask`)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the task function (a [task_options] table in the config file)."""
    seed: int = 0
    """Torch seed set on every rank before the task is built; passed as `seed=` to a task function that
    takes one (unless task_options sets it)."""
    ranks: int = 4
    """Pipeline ranks (processes per data-parallel replica)."""
    dp: int = 1
    """Data-parallel replicas; ranks * dp * tp processes in all."""
    ep: int = 1
    """Expert parallelism (models with MoE layers): each MoE layer's experts are spread over ep of the dp replicas
    (ep divides dp; its all-to-alls overlap with the other microbatch's compute in DualPipe(V)'s F&B pairs)."""
    tp: int = 1
    """Tensor-parallel degree: each stage's layers are sharded over tp neighbouring processes with the task's plan
    (the gpt task's `gpt_tp_plan`, a task's `TrainTask.tp_plan`; the hf task: the model's published plan)."""
    balance: str = "uniform"
    """"uniform", "params" or "time" (profiled on the first microbatch of step 0's batch)."""
    steps: int = 60
    """Optimizer steps in all (a resumed run continues up to this step); with the pipeline's `accumulation_steps` A
    each step is A batches. Every step count of a run (log_every, eval_every, save_every, checkpoint names, the
    step of metrics.jsonl) counts these."""
    batch_size: int = 32
    """Samples per batch over all replicas (the task's `batch(index, batch_size)`); a step with `accumulation_steps`
    A trains A batches."""
    batch_check: str = "first"
    """Compare a fingerprint of task.batch()'s global batch across all ranks (it must be the same everywhere): on
    the run's "first" step, on "every" step (a debugging aid: one small all-gather a step), or "never"."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer and its learning-rate schedule."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The log, the evaluations and what is written to out_dir."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints: saving, resuming, the Hugging Face export."""
    pipeline: PipelineConfig = field(default_factory=default_pipeline)
    """How to pipeline and train (`duplexpipe.PipelineConfig`): its schedule ("auto" plans it), microbatches,
    precision, data parallelism, safety and observation; the schedule may also be a schedule file (.json as
    'duplexpipe export' writes it, .csv as torch.distributed.pipelining's), which states the ranks and
    microbatches (verified before any process starts)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "dp", "ep", "tp", "steps", "batch_size"):
            _at_least(name, getattr(self, name), 1)
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..{MAX_SEED} (2**63 - 1, torch's generators take a signed 64-bit "
                             f"seed), got {self.seed}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be <= {MAX_BATCH_SIZE:,} samples per step, got {self.batch_size:,}; "
                             "to train on more samples per optimizer step use accumulation_steps")
        if self.batch_size % self.dp:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by dp={self.dp}: every replica trains an "
                             f"equal share of each batch; use a batch_size that is a multiple of {self.dp}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (experts are spread over ep of the dp replicas)")
        self.task = TASK_ALIASES.get(self.task, self.task)
        for name, choices in (("balance", BALANCES), ("batch_check", BATCH_CHECKS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        microbatches = self.pipeline.num_microbatches
        if microbatches is not None and self.batch_size < microbatches * self.dp:
            raise ValueError(f"batch_size {self.batch_size} is smaller than microbatches x dp = {microbatches} x "
                             f"{self.dp}: every replica needs at least one sample per microbatch")
        if self.metrics.profile_steps is not None and profile_range(self.metrics.profile_steps)[1] > self.steps:
            raise ValueError(f"profile_steps {self.metrics.profile_steps!r} ends after the run's {self.steps} steps")
        if self.pipeline.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel shards the sequence over the tensor-parallel ranks: it needs tp > 1")

    def parts_needed(self) -> int:
        """How many model parts the schedule needs (the model needs at least that many blocks)."""
        return self.schedule_object().num_groups

    def schedule_object(self) -> Any:
        """The Schedule of the pipeline's registry name (with its schedule_options) or schedule file, for `ranks`;
        not for "auto"."""
        return resolve_schedule(with_defaults(self.pipeline), self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (JSON-ready: a value JSON cannot hold, such as a codec object, as its repr)."""
        return json.loads(json.dumps(asdict(self), default=repr))  # type: ignore[no-any-return]


def lr_factor(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """The LR multiplier after `step` optimizer steps: linear warm-up over `warmup` steps, then
    `schedule` ("constant", "cosine", "linear") down to `min_ratio` at step `total` - 1."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")

    def factor(step: int) -> float:  # a plain function: LambdaLR keeps none of it in its state_dict
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
