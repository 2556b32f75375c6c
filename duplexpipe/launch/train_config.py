"""`duplexpipe train`'s run configuration: the fields, a TOML config file, the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

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
P2P_COMPRESSIONS = ("none", "bf16", "fp8", "int8")
"""Stage-to-stage send formats: "none" (as computed) or a `duplexpipe.comm.P2P_COMPRESSION` name."""
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd", "int8", "topk", "randomk", "threshold", "dgc")
"""Data-parallel gradient compression methods (duplexpipe.dp_options.compression.METHOD_NAMES)."""
ZERO_STAGES = (0, 1, 2)
NONFINITE_POLICIES = ("raise", "skip")
"""`nonfinite_grads` values (duplexpipe.train.nonfinite.NONFINITE_GRADS): stop the run, or skip the step and go on."""
BATCH_CHECKS = ("first", "every", "never")
"""`batch_check` values: compare the batch's fingerprint across ranks on a run's first step, on every step, never."""
CHOICES: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "optimizer": OPTIMIZERS, "lr_schedule": LR_SCHEDULES, "precision": PRECISIONS, "balance": BALANCES,
    "zero_stage": ZERO_STAGES, "nonfinite_grads": NONFINITE_POLICIES, "batch_check": BATCH_CHECKS})
"""The values some TrainConfig fields take (the command line offers them as choices)."""
SCHEDULE_FILES = (".json", ".csv")
"""A `schedule` ending so is a schedule file: duplexpipe's JSON or torch.distributed.pipelining's CSV."""


def is_schedule_file(schedule: str) -> bool:
    """True when `schedule` names a schedule file rather than a registry name."""
    return schedule.lower().endswith(SCHEDULE_FILES)


@documented
@dataclass
class TrainConfig:
    """One training run; every field can be set in the TOML config file under the same name."""

    task: str = DEFAULT_TASK
    """"path/to/file.py:function" or "package.module:function" returning a TrainTask, or a bundled task: "gpt" (the
    default) or "hf" (fine-tune a Hugging Face model directory on a text file: options model=DIR, data=FILE). The
    task's module is imported and the function called on every rank: this runs Python code (a task named in a
    config file must be a function annotated `-> TrainTask`)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the task function (a [task_options] table in the config file)."""
    schedule: str = "dualpipe"
    """Schedule name from the registry, "auto" (profile, plan under `memory_limit`, run the winner), or a schedule
    file: .json (as 'duplexpipe export' writes it) or .csv (torch.distributed.pipelining's), which states the ranks
    and microbatches (verified before any process starts)."""
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
    sequence_parallel: bool = False
    """With tp > 1: norms, the residual stream and the stage-to-stage messages hold 1/tp of the sequence (the
    sequence length must be divisible by tp)."""
    microbatches: int = 8
    """Microbatches per step."""
    steps: int = 60
    """Training steps in all (a resumed run continues up to this step)."""
    batch_size: int = 32
    """Samples per step over all replicas (the task's `batch(step, batch_size)`)."""
    optimizer: str = "adamw"
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
    precision: str = "fp32"
    """"fp32", "bf16" or "fp16"."""
    p2p_compression: str = "none"
    """Stage-to-stage sends: "none" (as computed), "bf16", "fp8" (per-row scales) or "int8" (blockwise), with
    options as in "int8(block=128)" or "fp8(fmt=e5m2)", or an "activation, gradient" pair such as "fp8, none";
    see PipelineConfig.p2p_compression."""
    grad_compression: str = "none"
    """Data-parallel gradient compression: "none" (exact) or a duplexpipe.dp_options.compression method name, with
    its defaults or with options as in "powersgd(rank=1)" or "dgc(ratio=0.001)"."""
    zero_stage: int = 0
    """ZeRO over the data-parallel replicas: 0 none, 1 optimizer state sharded, 2 gradients too (FSDP2)."""
    memory_limit: str | None = None
    """schedule "auto" only: the bytes each rank may use, e.g. "2GiB" (None: no limit)."""
    grad_clip_norm: float | None = 1.0
    """Global gradient-norm clip (None, or 0 in the config file or on the command line: off)."""
    activation_checkpointing: bool = False
    """Recompute every stage's activations in backward."""
    balance: str = "uniform"
    """"uniform", "params" or "time" (profiled on the first microbatch of step 0's batch)."""
    seed: int = 0
    """Torch seed set on every rank before the task is built; passed as `seed=` to a task function that
    takes one (unless task_options sets it)."""
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
    """TensorBoard scalars under out_dir/tensorboard when the tensorboard package is installed (skipped quietly
    otherwise); --no-tensorboard turns them off."""
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
    """At the end, write the trained model here as a Hugging Face model directory (Hugging Face tasks only)."""
    timeout_s: float = 180.0
    """Runtime timeout for blocked communication, in seconds."""
    nonfinite_grads: str = "raise"
    """A step whose gradients hold NaN or inf: "raise" (every rank stops naming the step and the first stage and
    parameter; the run exits 1 and the weights are those before that step) or "skip" (the step is skipped on every
    rank and counted; training goes on)."""
    batch_check: str = "first"
    """Compare a fingerprint of task.batch()'s global batch across all ranks (it must be the same everywhere): on
    the run's "first" step, on "every" step (a debugging aid: one small all-gather a step), or "never"."""
    pipeline: dict[str, Any] = field(default_factory=dict)
    """PipelineConfig settings that no field above carries, by field name ({"accumulation_steps": 2, "zero":
    {"hpz_ranks": 2}}): each is a flag and a config-file key of its own (`duplexpipe.launch.train_settings`)."""
    def __post_init__(self) -> None:
        for name in ("ranks", "dp", "ep", "tp", "microbatches", "steps", "batch_size", "eval_batches"):
            _at_least(name, getattr(self, name), 1)
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (experts are spread over ep of the dp replicas)")
        for name in ("warmup", "log_every", "save_every", "keep", "eval_every"):
            _at_least(name, getattr(self, name), 0)
        self.task = TASK_ALIASES.get(self.task, self.task)
        for name, choices in (("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES),
                              ("precision", PRECISIONS), ("balance", BALANCES), ("batch_check", BATCH_CHECKS),
                              ("nonfinite_grads", NONFINITE_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not self.lr > 0 or self.weight_decay < 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"need lr > 0, weight_decay >= 0 and 0 <= momentum < 1, got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}, momentum={self.momentum}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            self.grad_clip_norm = None  # 0 turns clipping off (TOML and the CLI have no None)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.batch_size < self.microbatches * self.dp:
            raise ValueError(f"batch_size {self.batch_size} is smaller than microbatches x dp = {self.microbatches} x "
                             f"{self.dp}: every replica needs at least one sample per microbatch")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel shards the sequence over the tensor-parallel ranks: it needs tp > 1")
        self._check_parallelism()

    def _check_parallelism(self) -> None:
        """The compressions' names, zero_stage and memory_limit: known values, and the limit only with schedule
        "auto" (options are checked by PipelineConfig before any process starts)."""
        from duplexpipe.dp_options.labels import parse_labels
        from duplexpipe.sizes import parse_bytes

        for name, known, most in (("p2p_compression", P2P_COMPRESSIONS, 2), ("grad_compression", GRAD_COMPRESSIONS, 1)):
            labels = parse_labels(getattr(self, name))
            if len(labels) > most or any(label not in known for label, _ in labels):
                raise ValueError(f"{name} must be one of {', '.join(known)} (with options as in 'int8(block=128)'"
                                 f"{', or an activation, gradient pair' if most == 2 else ''}), "
                                 f"got {getattr(self, name)!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {self.zero_stage}")
        if self.memory_limit is not None:
            if self.schedule != "auto":
                raise ValueError(f"memory_limit is the planner's cap for schedule 'auto', but schedule is "
                                 f"{self.schedule!r}")
            parse_bytes(self.memory_limit)

    def parts_needed(self) -> int:
        """How many model parts the schedule needs (the model needs at least that many blocks)."""
        return self.schedule_object().num_groups

    def schedule_object(self) -> Any:
        """The Schedule of a registry name (with `pipeline["schedule_options"]`) or of a schedule file; not for
        "auto"."""
        from duplexpipe.schedules.ir import load_json, load_torch_csv
        from duplexpipe.schedules.registry import build

        if is_schedule_file(self.schedule):
            if self.schedule.lower().endswith(".csv"):
                return load_torch_csv(self.schedule, num_microbatches=self.microbatches)
            return load_json(self.schedule)
        return build(self.schedule, self.ranks, self.microbatches, **self.pipeline.get("schedule_options", {}))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (JSON-ready)."""
        return asdict(self)


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


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
