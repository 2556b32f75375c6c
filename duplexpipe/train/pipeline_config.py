"""`PipelineConfig` (every setting of a Pipeline, in sections, checked when built) and `StepInfo` (what a step did)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeGuard

import torch

from duplexpipe.comm.adaptive import CompressionReport, ExposureReport
from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.nonfinite import check_policy
from duplexpipe.comm.p2p_codecs import p2p_codec_pair
from duplexpipe.dp_options.compression import Options, compression_options
from duplexpipe.dp_options.zero import ZERO_STAGES, ZeroOptions, check_residency, check_zero, zero_refusal
from duplexpipe.fielddoc import documented
from duplexpipe.model.stages import check_checkpointing
from duplexpipe.parallel import DEFAULT_BUCKET_BYTES, check_strategy_name
from duplexpipe.runtime import RuntimeConfig
from duplexpipe.runtime.config import GradsReadyHook
from duplexpipe.runtime.memory import MemoryReport
from duplexpipe.runtime.offload import check_offload
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.timeline import Timeline
from duplexpipe.sizes import memory_bytes
from duplexpipe.train.compile import compile_options
from duplexpipe.train.float8 import Float8Options, float8_options
from duplexpipe.train.nonfinite import check_nonfinite_policy
from duplexpipe.train.precision import LossScaleConfig, autocast_dtype

AUTO = "auto"
"""The PipelineConfig.schedule value that plans the schedule (the registry's `auto` generator is one candidate)."""
AUTO_PLAN_KEYS = ("schedules", "microbatches", "chunks", "zero_stages", "compressions", "dp_link", "p2p_link",
                  "optimizer_factor", "gradient_factor", "cores", "tp_link")
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
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""Builds an LR scheduler on the optimizer, e.g. `lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)`."""


LossFn = Callable[[Any, Any], torch.Tensor]
"""loss_fn(last stage output, targets) -> scalar mean loss over the microbatch."""
DEFAULT_MICROBATCHES = 4
"""num_microbatches when it is left unset (None) and schedule is not "auto"."""
SCHEDULE_FILES = (".json", ".csv")
"""A `schedule` ending so is a schedule file: duplexpipe's JSON or torch.distributed.pipelining's CSV."""
MAX_TIMEOUT_S = 7 * 24 * 3600
"""Longest bound on one wait (`SafetyConfig.timeout_s`, `compile_timeout_s`): a week; longer is no bound at all (and
torch's process-group timeouts overflow long before infinity)."""


@documented
@dataclass
class PrecisionConfig:
    """The precision of the compute and of the stage-to-stage sends."""

    dtype: str = "fp32"
    """"fp32"; "bf16" (bfloat16 autocast); or "fp16" (float16 autocast with dynamic loss scaling)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling settings, used with dtype "fp16"."""
    p2p_compression: Any = None
    """Low-precision stage-to-stage sends: None (as computed), "bf16" (bf16 both ways), "fp8" (e4m3
    activations, e5m2 gradients, an fp32 scale per row) or "int8" (blocks of 256, fp32 scale per block), with
    options as in "int8(block=128)"; or a duplexpipe.comm.codec.Codec for both directions, or an (activation,
    gradient) pair of names, codecs or None (or "fp8, none"). See duplexpipe.comm.p2p_codecs."""
    float8: str | Float8Options | None = None
    """Float8 compute on torchao's Float8Linear: None (off), a recipe "tensorwise" or "rowwise", with options as in
    "rowwise(emulate=true)", or a `train.float8.Float8Options`. Each stage's linears whose dimensions are divisible
    by 16 convert, except the output projection, MoE routers and MoE blocks (kept in high precision, logged); the
    weights stay high-precision parameters (checkpoints unchanged). emulate unset: emulated where the device has no
    FP8 GEMMs (CPU, CUDA below 8.9), said in the log. Under a split backward I forms the input gradients and W the
    weight gradients, each with its own scaling."""

    def __post_init__(self) -> None:
        autocast_dtype(self.dtype)
        p2p_codec_pair(self.p2p_compression, "PrecisionConfig.p2p_compression")
        float8_options(self.float8)


@documented
@dataclass
class DataParallelConfig:
    """How the data-parallel replicas reduce gradients and shard optimizer state (no effect without replicas)."""

    grad_compression: str | Options | None = None
    """Data-parallel gradient compression: a method name ("bf16", "fp16", "powersgd", "int8", "topk", "randomk",
    "threshold", "dgc"; `duplexpipe.dp_options.compression.METHOD_NAMES`) with its defaults or with options as in
    "powersgd(rank=1)", or an options object from `duplexpipe.dp_options.compression` (e.g. Int8Options(block=128),
    DGCOptions(ratio=0.001, warmup_steps=20)); "none": exact fp32 all-reduce. None (unset): exact, or with
    schedule="auto" the planner's choice among its measured methods that this configuration accepts
    (`planner.dp_comm.COMPRESSIONS`; schedule_options["compressions"] narrows them); set (also "none"), it is fixed.
    Sparsifiers assume SGD (DGC: SGD with momentum=0, the momentum and the gradient clipping go in DGCOptions,
    grad_clip_norm must be None). No effect (a warning) without data parallelism."""
    dp_strategy: str | None = None
    """Data-parallel strategy name (duplexpipe.parallel.STRATEGY_NAMES); None: "compressed" when
    grad_compression compresses, else "replicated"."""
    grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Gradients are reduced in fixed buckets of at most this many bytes, each started as soon as its
    gradients are final (in the order they become final)."""
    zero_stage: int | None = None
    """ZeRO over the data-parallel replicas: 0 none; 1 optimizer state sharded (reduce-scatter, step on the
    shard, all-gather; an elementwise optimizer such as SGD/Adam/AdamW); 2 gradients sharded too (torch
    FSDP2, reduced stage by stage as they become final); 3 parameters sharded too at rest (FSDP2 driven by the
    schedule's UNSHARD / RESHARD / REDUCE_GRAD actions per stage, see reshard_window).
    grad_compression may be "bf16", "fp16" or "int8" (int8 = ZeRO++ qgZ) with ZeRO. None (unset): 0, or with
    schedule="auto" the planner's choice among the stages this configuration accepts; set, it is fixed."""
    zero: ZeroOptions = field(default_factory=ZeroOptions)
    """ZeRO++ options for zero_stage 1, 2 and 3: quantized_gradients (qgZ), quantized_weights (qwZ), hpz_ranks
    (zero_stage 2 only)."""
    reshard_window: int | None = None
    """zero_stage=3: how many of a rank's stages may hold unsharded parameters at once (the schedule gets an
    UNSHARD before a stage's use and a RESHARD once the window needs its room); None: all of the rank's stages (one
    all-gather and one reduce-scatter per stage per step). At least 1, at most the stages of a rank."""
    unshard_lookahead: int = 1
    """zero_stage=3: how many compute actions ahead of a stage's first use its UNSHARD (all-gather) is issued, so
    it overlaps the compute before it (0: right before the use)."""

    def __post_init__(self) -> None:
        if not isinstance(self.grad_bucket_bytes, int) or self.grad_bucket_bytes < 1:
            raise ValueError(f"grad_bucket_bytes must be an int >= 1, got {self.grad_bucket_bytes!r}")
        compression_options(self.grad_compression)
        check_residency(self.zero_stage or 0, self.reshard_window, self.unshard_lookahead)


@documented
@dataclass
class SafetyConfig:
    """Bounds and checks: how long a wait may last, what is compared across ranks, what NaN or inf does."""

    timeout_s: float = 180.0
    """Seconds a blocked receive or send may wait before the runtime raises."""
    compile_timeout_s: float = 1800.0
    """With `compile` (or stages the user compiled on this rank): the bound on every wait of the first step and of
    the first evaluation, which compile (inductor can take minutes on a large model), in place of `timeout_s`;
    later steps that recompile are bounded by `timeout_s`."""
    check_inputs_every_step: bool = True
    """False: the ranks agree on the batch shape on the first step only (faster when every batch has
    the same shape; a differently shaped batch then stops every rank with an error). See RuntimeConfig."""
    check_replicas: bool = True
    """At construction, check that every copy of a model part (DualPipe mirrors, data-parallel
    replicas) starts with identical weights; raise ValueError otherwise."""
    nonfinite_grads: str = "raise"
    """What a step whose gradients hold NaN or inf does (checked on every step, one all-reduce with the gradient
    norm): "raise" (the default: every rank stops with NonFiniteGradientError naming the step and the first stage
    and parameter, before the optimizer steps) or "skip" (the step is skipped on every rank and counted in
    `Pipeline.skipped_steps`, as fp16 overflows are). With precision "fp16" an overflow is the loss scaler's: the
    step is skipped and the scale lowered, whatever this says."""
    nonfinite_sends: str = "warn"
    """A compressed send holding NaN or inf (it always arrives non-finite): "warn" (count it, warn once) or
    "raise" (stop every rank; not with precision "fp16", whose overflow steps are routine)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "compile_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
            if not value <= MAX_TIMEOUT_S:
                raise ValueError(f"{name} must be at most {MAX_TIMEOUT_S:,} seconds (a week), got {value!r}")
        check_policy(self.nonfinite_sends, "SafetyConfig.nonfinite_sends")
        check_nonfinite_policy(self.nonfinite_grads)


@documented
@dataclass
class ObserveConfig:
    """What a step measures and records about itself."""

    record_timeline: bool = True
    """Record the measured timeline of every step (StepInfo.timeline): this rank's own events, kept on the rank
    (gathering them is a separate, collective step: `runtime.gather_timeline`)."""
    record_tp_lane: bool = False
    """With tensor parallelism and record_timeline: time DTensor's collectives on the timeline's "tp" lane
    (`tp.lane`). A dispatch mode then sees every operator of the step: measured +11-21% CPU per step on
    an overhead-bound PP=2 x TP=2 GPT (4 gloo ranks, 2 cores), hence off by default."""
    count_saved_bytes: bool = False
    """Measure each step's peak saved-activation bytes per rank (`StepInfo.peak_saved_bytes`, counted as
    `profile_parts` counts them). Off by default (a hook per saved tensor, a few percent of an overhead-bound
    step); False: peak_saved_bytes stays 0."""
    measure_memory: bool = False
    """Measure what each rank holds over every step (`StepInfo.memory`, a `MemoryReport`): the bytes of its
    parameters (unsharded ones as they appear), gradients, optimizer state, saved activations and in-flight
    messages, each kind's peak and the peak of their sum over the step's actions, with the curve after each
    action (on CUDA also torch.cuda.max_memory_allocated). Walks those tensors after every action, so off by
    default; `duplexpipe train --measure-memory` prints the peaks in its summary."""


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
    `optimizer_factor`, `p2p_link`, `tp_link`, ...; `microbatches`, `zero_stages`, `compressions` only for fields
    left unset), profile_parts' `repeats`, `warmup`, `timer`, `fit_rows`, `fused`, `evict_bytes`, and the
    calibration's `calibrate` (False: none), `calibration_budget_s` (default 3 s of measured steps),
    `calibration_cache` (a directory; None: no cache; default `planner.calibration_cache.default_cache_dir()`,
    ~/.cache/duplexpipe/calibration, keyed by the parts, the sample, P, D, T, the machine and these settings)
    and `cpu_timer`. The calibration also measures the links it is not given: `p2p_link` (round trips) and,
    under tensor parallelism, `tp_link` (all-reduces over the TP group; without a calibration and no `tp_link`
    the planner's default, an NVLink node)."""
    memory_limit: int | str | None = None
    """schedule="auto" only: the bytes each rank may use (an int, or a size such as "40GiB"); None: no cap."""
    grad_clip_norm: float | None = None
    """Clip to this global L2 norm over all ranks (each weight group counted once); None: no clipping."""
    accumulation_steps: int = 1
    """Calls to `step` per optimizer step. Their gradients are summed, each call weighted by its share
    of the window's samples, so the applied gradient is that of the mean loss over every sample of the
    window (a sum of microbatch gradients of that mean, not an average of per-call averages). In `duplexpipe
    train`, the batches of each of its `steps` (which count optimizer steps)."""
    activation_checkpointing: bool | str | dict[str, int] | Collection[int] = False
    """Recompute activations in backward instead of keeping them, once per microbatch (under a split backward too:
    recomputed at I, kept for W): "full" (or True) every stage whole; "selective" every stage, saving the matmuls'
    and attention's outputs and recomputing the cheap operators (torch's selective checkpointing); {"every": k}
    every k-th block of the model, each on its own (the layers of `from_layers` parts, a Hugging Face part's
    decoder layers; on the command line every=k); a collection of stage indices those stages whole; False none."""
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
    from duplexpipe.schedules.registry import names

    if isinstance(schedule, Schedule) or schedule == AUTO or is_schedule_file(schedule):
        return
    if not isinstance(schedule, str) or schedule not in names():
        raise ValueError(f"PipelineConfig.schedule must be a Schedule, a schedule file ({', '.join(SCHEDULE_FILES)}) "
                         f"or one of {', '.join(names())}; got {schedule!r}")


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


def runtime_config(config: PipelineConfig, *, fb_overlap: bool, on_grads_ready: GradsReadyHook | None,
                   p2p_meter: WireMeter | None) -> RuntimeConfig:
    """The runtime's settings for `config` (a Pipeline's, and its planner's calibration runs'): `fb_overlap` as the
    stages decided it (`Experts.note_overlap`), the data-parallel strategy's grads-ready hook and the send meter."""
    act_codec, grad_codec = p2p_codec_pair(config.precision.p2p_compression, "PrecisionConfig.p2p_compression")
    safety, observe = config.safety, config.observe
    return RuntimeConfig(timeout_s=safety.timeout_s, record_timeline=observe.record_timeline,
                         autocast_dtype=autocast_dtype(config.precision.dtype),
                         check_inputs_every_step=safety.check_inputs_every_step,
                         count_saved_bytes=observe.count_saved_bytes,
                         measure_memory=observe.measure_memory, activation_codec=act_codec,
                         gradient_codec=grad_codec, nonfinite_sends=safety.nonfinite_sends, p2p_meter=p2p_meter,
                         on_grads_ready=on_grads_ready, fb_overlap=fb_overlap)


@documented
@dataclass(frozen=True)
class StepInfo:
    """What the last `Pipeline.step` call did."""

    loss: float
    """Mean loss of the batch (averaged over data-parallel replicas); unscaled."""
    applied: bool
    """True when this call ended an accumulation window and the optimizer stepped."""
    skipped: bool
    """True when the window's gradients held NaN or inf (an fp16 overflow, or nonfinite_grads="skip") and the step
    was skipped everywhere."""
    grad_norm: float | None
    """Global gradient norm before clipping, at the end of every accumulation window (None mid-window); NaN or inf
    when the gradients held such values (never a masked number)."""
    loss_scale: float
    """The loss scale this call used (1.0 unless fp16)."""
    timeline: Timeline | None
    """This rank's measured timeline of the call (None when not recorded); on window ends its spans show
    the data-parallel bucket reductions on lane "dp"."""
    wire_bytes: float = 0.0
    """Ring-model bytes this rank sent for data-parallel gradient reduction in this call (comm.WireMeter)."""
    peak_saved_bytes: int = 0
    """The most bytes this rank's live activations kept for backward at once during the call, counted
    as `profile_parts` counts them (see StepResult.peak_saved_bytes)."""
    memory: MemoryReport | None = None
    """What this rank held during the call, measured (ObserveConfig.measure_memory; None when off), the optimizer
    state included."""
    exposure: ExposureReport | None = None
    """Exposed communication of the call: per data-parallel bucket the time from the end of the window's compute until
    its reduction completed, per stage link the time this rank's receives blocked. A recorded timeline shows the
    waits on lane "exposed"."""
    compression: CompressionReport | None = None
    """grad_compression="adaptive" and / or p2p_compression="adaptive": the rung each bucket ("bucket i", on window
    ends) and each directed stage link ("link a->b") used in the call, their measured exposure and the moves made at
    its end from the previous call's agreed exposure (None without adaptive compression)."""

