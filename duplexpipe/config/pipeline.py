"""`PipelineConfig`: every setting of a Pipeline, in sections, checked when built (torch-free), and the schedule it
names (`resolve_schedule`); the keys schedule="auto" takes and the fields it may choose."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeGuard

from duplexpipe.config.activations import check_checkpointing, check_offload
from duplexpipe.config.compile import compile_options
from duplexpipe.config.sections import (
    DataParallelConfig,
    ObserveConfig,
    PrecisionConfig,
    SafetyConfig,
    check_strategy_name,
)
from duplexpipe.dp_options.compression import Options, compression_options
from duplexpipe.dp_options.zero import ZERO_STAGES, check_zero, zero_refusal
from duplexpipe.fielddoc import documented
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Schedule, load_json, load_torch_csv
from duplexpipe.sizes import memory_bytes

AUTO = "auto"
"""The PipelineConfig.schedule value that plans the schedule (the registry's `auto` generator is one candidate)."""
AUTO_PLAN_KEYS = ("schedules", "microbatches", "chunks", "zero_stages", "compressions", "dp_link", "p2p_link",
                  "optimizer_factor", "gradient_factor", "cores", "tp_link", "host_link", "offload")
"""schedule_options keys of schedule="auto" that go to the planner: the fields of `planner.plan.PlanConfig` a
user sets (the others come from the Pipeline; a test keeps the two lists equal)."""
AUTO_PROFILE_KEYS = ("repeats", "warmup", "timer", "fit_rows", "fused", "evict_bytes")
"""schedule_options keys of schedule="auto" that go to `profile_parts`."""
AUTO_CALIBRATION_KEYS = ("calibrate", "calibration_budget_s", "calibration_cache", "cpu_timer")
"""schedule_options keys of schedule="auto" for the in-pipeline calibration and its cache
(`train.planning.calibration`)."""
AUTO_FIXED: Mapping[str, str] = MappingProxyType({"num_microbatches": "microbatches",
                                                  "data_parallel.zero_stage": "zero_stages",
                                                  "data_parallel.grad_compression": "compressions"})
"""PipelineConfig fields (a section's as "section.field") that, when set (not None), fix the planner's choice, and
the schedule_options key that narrows the planner's search when the field is left unset (`fixed_choice` reads
them)."""
DEFAULT_MICROBATCHES = 4
"""num_microbatches when it is left unset (None) and schedule is not "auto"."""
SCHEDULE_FILES = (".json", ".csv")
"""A `schedule` ending so is a schedule file: duplexpipe's JSON or torch.distributed.pipelining's CSV."""


@documented
@dataclass
class PipelineConfig:
    """How to pipeline and train; every field has a usable default (`PipelineConfig("1f1b", 8)`: the schedule and
    its microbatches). Settings of one concern are grouped in a section (precision, data_parallel, safety,
    observe)."""

    schedule: str | Schedule = "1f1b"
    """A registry name (`duplexpipe.schedules.registry.names()`), a schedule file (.json as 'duplexpipe export'
    writes it, or torch.distributed.pipelining's .csv), a ready Schedule for the pp ranks, or "auto": measure the
    parts on a sample (rank 0's profile and an in-pipeline calibration of the runtime, cached), plan under
    `memory_limit` and run the winner: a step before construction (`duplexpipe.plan_pipeline`; `from_layers` and
    `from_pretrained` call it). With "auto" the planner chooses the schedule and every field that is left unset
    (None): num_microbatches, data_parallel.zero_stage, data_parallel.grad_compression; a field that is set is
    fixed, and the planner plans only with that value. `Pipeline.plan` and the log line (logger
    "duplexpipe.plan") say what was chosen; it is what runs."""
    num_microbatches: int | None = None
    """Microbatches per step (ignored when `schedule` is a Schedule or a .json file); the batch must divide evenly.
    None (unset): 4, or with schedule="auto" the planner's choice (among schedule_options["microbatches"] if given,
    else the divisors of the batch from P to 8P); set, it is fixed, also under "auto"."""
    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword options for the schedule generator, e.g. {"chunks": 2}. With "auto": the planner's
    PlanConfig fields (`schedules`, `microbatches`, `zero_stages`, `compressions`, `chunks`, `cores`,
    `optimizer_factor`, `p2p_link`, `tp_link`, `host_link` and `offload` (activation offload's copy link and the
    fractions to try; a fixed `activation_offload` is planned as none), ...; `microbatches`, `zero_stages`,
    `compressions` only for fields left unset), profile_parts' `repeats`, `warmup`, `timer`, `fit_rows`, `fused`,
    `evict_bytes`, and the calibration's `calibrate` (False: none), `calibration_budget_s` (default 3 s of measured
    steps), `calibration_cache` (a directory; None: no cache; default `planner.calibration_cache.
    default_cache_dir()`, ~/.cache/duplexpipe/calibration, keyed by the parts, the sample, P, D, T, the machine and
    these settings) and `cpu_timer`. The calibration also measures the links it is not given: `p2p_link` (round
    trips), under tensor parallelism `tp_link` (all-reduces over the TP group; without a calibration and no
    `tp_link` the planner's default, an NVLink node), and on CUDA `host_link` (pinned copies each way; on CPUs
    none is known and offload is never planned)."""
    memory_limit: int | str | None = None
    """schedule="auto" only: the bytes each rank may use (an int, or a size such as "40GiB"); None: no cap."""
    grad_clip_norm: float | None = None
    """Clip to this global L2 norm over all ranks (each weight group counted once); None: no clipping."""
    accumulation_steps: int = 1
    """Calls to `step` per optimizer step. Their gradients are summed, each call weighted by its share
    of the window's samples, so the applied gradient is that of the mean loss over every sample of the
    window (a sum of microbatch gradients of that mean, not an average of per-call averages). In `duplexpipe
    train`, the batches of each of its `steps` (which count optimizer steps)."""
    activation_checkpointing: bool | str | dict[str, Any] | Collection[int] = False
    """Recompute activations in backward instead of keeping them, once per microbatch (under a split backward too:
    recomputed at I, kept for W): "full" (or True) every stage whole; "selective" every stage, saving the matmuls'
    and attention's outputs and recomputing the cheap operators (torch's selective checkpointing); {"every": k}
    every k-th block of the model, each on its own (the layers of `from_layers` parts, a Hugging Face part's
    decoder layers; on the command line every=k); {"blocks": [i, ...]} those blocks of the model, by their index
    in the whole model (on the command line blocks=0,3); a collection of stage indices those stages whole; False
    none."""
    activation_offload: bool | float = False
    """Move what forwards save for backward to host memory while their backward is far away, scheduled from each
    rank's list: after each F, the live forwards whose B or I comes last go to host (True: all but the nearest; a
    fraction f: the furthest f of them) and come back one compute action before their B or I (CUDA: pinned buffers,
    copies on a side stream overlapping the compute). Exact; `observe.measure_memory` reports the bytes moved."""
    sequence_parallel: bool = False
    """With tensor parallelism (a mesh with tp > 1 and a `tp_plan`): activations between the TP regions (norms,
    residual stream) and every stage-to-stage message hold this TP rank's 1/TP of the sequence (each TP rank sends
    only its shard). The plan must shard them so (the bundled plans take it: `gpt_tp_plan(sequence_parallel=...)`,
    `moe_tp_plan`; `from_pretrained` builds its plan from this field); Hugging Face parts then build their masks
    and positions for the whole sequence. The sequence length must be divisible by the TP degree."""
    fb_overlap: bool = True
    """Schedules with F&B pairs (DualPipe, DualPipeV) and stages with MoE layers (`duplexpipe.moe`): run each
    pair's forward and backward interleaved, so every expert all-to-all of one microbatch is in flight while
    the other computes (bit-equal to False). False: the forward, then the backward. Nothing to overlap (no
    pairs, or no MoE layers) runs as False does."""
    compile: bool | dict[str, Any] = False
    """torch.compile each stage's blocks in place (`duplexpipe.train.compile`): True (torch's defaults: inductor),
    or a dict of torch.compile's options `backend`, `mode`, `options`, `dynamic`, `fullgraph` (checked here: a
    ValueError names what torch rejects). Blocks: the layers of `from_layers` parts, the decoder layers of Hugging
    Face parts, the pieces around MoE layers, else whole parts; parts the user compiled stay as they are. Under a
    schedule with I and W, inductor and aot_eager compile each block's backward as two graphs (I, W). The first
    step compiles (logged by "duplexpipe.compile", with every later recompilation and its reason), bounded by
    `safety.compile_timeout_s`."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The compute's autocast dtype, fp16's loss scaling and the stage-to-stage send format."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    """Gradient compression, strategy, buckets and ZeRO over the data-parallel replicas."""
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    """Timeouts, the checks across ranks and what NaN or inf does."""
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    """What each step records (its timeline, the TP lane, saved bytes)."""

    def __post_init__(self) -> None:
        check_schedule_name(self.schedule)
        memory_bytes(self.memory_limit)
        compile_options(self.compile)
        check_checkpointing(self.activation_checkpointing)
        for name, kind in (("precision", PrecisionConfig), ("data_parallel", DataParallelConfig),
                           ("safety", SafetyConfig), ("observe", ObserveConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"PipelineConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"PipelineConfig.sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        check_offload(self.activation_offload, "PipelineConfig.activation_offload")
        if not isinstance(self.fb_overlap, bool):
            raise ValueError(f"PipelineConfig.fb_overlap must be a bool, got {self.fb_overlap!r}")
        if self.schedule == AUTO:
            check_auto_options(self)
        elif self.memory_limit is not None:
            raise ValueError(f"PipelineConfig.memory_limit is for schedule='auto' (the planner's cap), but "
                             f"schedule is {self.schedule!r}")
        if self.safety.nonfinite_sends == "raise" and self.precision.dtype == "fp16":
            raise ValueError("SafetyConfig.nonfinite_sends='raise' with precision='fp16': dynamic loss scaling "
                             "overflows routinely and relies on inf/NaN gradients reaching its overflow check; "
                             "use nonfinite_sends='warn' with fp16")
        steps = self.accumulation_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {steps!r}")
        clip = self.grad_clip_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not (math.isfinite(clip) and clip > 0)):
            raise ValueError(f"grad_clip_norm must be a finite number > 0 or None (no clipping), got {clip!r}")
        dp = self.data_parallel
        compression = compression_options(dp.grad_compression)
        if dp.zero_stage is not None or self.schedule != AUTO:
            check_zero(dp.zero_stage or 0, dp.zero, compression, dp.dp_strategy)
        elif all(zero_refusal(z, compression, dp.zero, dp.dp_strategy) for z in ZERO_STAGES):
            check_zero(0, dp.zero, compression, dp.dp_strategy)  # no stage takes it: say why for stage 0
        if self.num_microbatches is not None and (not isinstance(self.num_microbatches, int)
                                                  or isinstance(self.num_microbatches, bool)
                                                  or self.num_microbatches < 1):
            raise ValueError(f"num_microbatches must be an int >= 1 or None, got {self.num_microbatches!r}")
        if not dp.zero_stage:
            check_strategy_name(dp.dp_strategy, compression.method != "none")
        if compression.method == "dgc" and self.grad_clip_norm is not None:
            raise ValueError(
                f"grad_clip_norm={self.grad_clip_norm} would clip DGC's averaged momentum-corrected velocity, "
                "not a gradient; DGC clips each rank's gradient before its momentum: set "
                "DGCOptions(clip_norm=...) and grad_clip_norm=None")


def is_schedule_file(schedule: object) -> TypeGuard[str]:
    """True when `schedule` names a schedule file (SCHEDULE_FILES) rather than a registry name."""
    return isinstance(schedule, str) and schedule.lower().endswith(SCHEDULE_FILES)


def check_schedule_name(schedule: object) -> None:
    """ValueError naming the value and the choices unless `schedule` is a registry name ("auto" among them), a
    schedule file's name or a Schedule (the file is read when the schedule is built)."""
    if isinstance(schedule, Schedule) or schedule == AUTO or is_schedule_file(schedule):
        return
    if not isinstance(schedule, str) or schedule not in registry.names():
        raise ValueError(f"PipelineConfig.schedule must be a Schedule, a schedule file ({', '.join(SCHEDULE_FILES)}) "
                         f"or one of {', '.join(registry.names())}; got {schedule!r}")


def check_auto_options(config: PipelineConfig) -> None:
    """schedule="auto": ValueError naming schedule_options keys it does not take, or a key that would widen a
    choice a set field fixes."""
    known = AUTO_PLAN_KEYS + AUTO_PROFILE_KEYS + AUTO_CALIBRATION_KEYS
    unknown = sorted(set(config.schedule_options) - set(known))
    if unknown:
        raise ValueError(f"schedule='auto' takes schedule_options {', '.join(known)}; got unknown {unknown}")
    for name, key in AUTO_FIXED.items():
        value = fixed_choice(config, name)
        if value is not None and key in config.schedule_options:
            raise ValueError(f"schedule='auto': PipelineConfig.{name}={value!r} fixes what schedule_options[{key!r}] "
                             f"would let the planner choose from; set one of them")


def fixed_choice(config: PipelineConfig, name: str) -> Any:
    """The value of an AUTO_FIXED field ("num_microbatches", "data_parallel.zero_stage", ...); None: left unset."""
    value: Any = config
    for part in name.split("."):
        value = getattr(value, part)
    return value


def with_choice(config: PipelineConfig, microbatches: int, zero_stage: int,
                grad_compression: str | Options | None) -> PipelineConfig:
    """`config` with M, the ZeRO stage and the gradient compression set (what a plan runs)."""
    dp = replace(config.data_parallel, zero_stage=zero_stage, grad_compression=grad_compression)
    return replace(config, num_microbatches=microbatches, data_parallel=dp)


def with_defaults(config: PipelineConfig) -> PipelineConfig:
    """`config` with the fields left unset (None) at their defaults: DEFAULT_MICROBATCHES microbatches, ZeRO 0."""
    dp = config.data_parallel
    return with_choice(config, config.num_microbatches or DEFAULT_MICROBATCHES, dp.zero_stage or 0,
                       dp.grad_compression)


def resolve_schedule(config: PipelineConfig, pp_size: int) -> Schedule:
    """The Schedule `config` names (or holds) for `pp_size` ranks; not for schedule="auto"."""
    if isinstance(config.schedule, Schedule):
        schedule = config.schedule
        if schedule.num_ranks != pp_size:
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks, "
                             f"but the pipeline group has {pp_size}")
        return schedule
    microbatches = config.num_microbatches or DEFAULT_MICROBATCHES
    if is_schedule_file(config.schedule):
        schedule = load_torch_csv(config.schedule, num_microbatches=microbatches) \
            if config.schedule.lower().endswith(".csv") else load_json(config.schedule)
        if schedule.num_ranks != pp_size:
            raise ValueError(f"schedule file {config.schedule} is for {schedule.num_ranks} ranks, "
                             f"but the pipeline group has {pp_size}")
        return schedule
    return registry.build(config.schedule, pp_size, microbatches, **config.schedule_options)
